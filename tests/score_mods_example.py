"""Score mods for the GPU tests (tests/test_score_mods_gpu.py), built with

    flashgen build --mods tests/score_mods_example.py --arch sm90a --kernels '*_mod_tempered_*,*_mod_tanh_cap_*' \
        --out build/mods

Each is an expression over the scaled score, the indices and captured tensors, with its derivative in
``score`` (gradients into captured tensors are not computed)."""
from flashgen.mods import ScoreMod

# a per-head temperature: the softmax of score * temp[h]
tempered = ScoreMod("score * temp[h]", tensors={"temp": "f32[H]"}, grad="temp[h]")

# a soft cap per head, as the built-in softcap is per call: cap[h] * tanh(score / cap[h])
tanh_cap = ScoreMod("cap[h] * tanh(score / cap[h])", tensors={"cap": "f32[H]"},
                    grad="1 - tanh(score / cap[h]) * tanh(score / cap[h])")
