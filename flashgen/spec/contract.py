"""Field runs that the Ampere (``sm80_*``) and Hopper (``sm90_*``) families' Params structs share,
in the order both C++ structs hold them.  Each family's ``ABI`` splices them in between its own
fields; the generated ABI headers check every offset against the compiled struct, as for any field."""
from __future__ import annotations

from flashgen.spec.core import Field

# The output's row and head strides and the lse's layout (rows in [num_queries, lse_rows) get +inf)
FORWARD_OUTPUT_FIELDS = (Field("out_stride_m", "i32"), Field("out_stride_h", "i32"), Field("lse_stride_b", "i32"),
                         Field("lse_stride_h", "i32"), Field("lse_rows", "i32"))

# The problem's sizes, the band mask (attention_common.h: Sequence) and the scaling of the scores
FORWARD_SHAPE_FIELDS = (
    Field("num_queries", "i32"), Field("num_keys", "i32"), Field("num_heads", "i32"),
    Field("num_sequences", "i32"), Field("head_dim", "i32"), Field("head_group", "i32"), Field("band_lo", "i32"),
    Field("band_hi", "i32"), Field("band_from_end", "i32"), Field("scale_log2", "f32"), Field("softcap_in", "f32"),
    Field("softcap_out", "f32"))

# What the backwards' shared prep and convert kernels (attention_common.h: backward_prep) and their
# workspace contract read: the forward's output and lse, dO, the workspace, the gradients, packed
# sequences' offsets ...
BACKWARD_POINTER_FIELDS = (
    Field("out_ptr", "ptr"), Field("dout_ptr", "ptr"), Field("lse_ptr", "ptr"), Field("lse_log2_ptr", "ptr"),
    Field("delta_ptr", "ptr"), Field("dq_accum_ptr", "ptr"), Field("dq_counter_ptr", "ptr"), Field("dq_ptr", "ptr"),
    Field("dk_ptr", "ptr"), Field("dv_ptr", "ptr"), Field("seqstart_q", "ptr"), Field("seqstart_k", "ptr"))

# ... the batch strides of O, dO and the gradients ...
BACKWARD_BATCH_STRIDE_FIELDS = (Field("out_stride_b", "i64"), Field("dout_stride_b", "i64"),
                                Field("dq_stride_b", "i64"), Field("dkv_stride_b", "i64"))

# ... and their row and head strides, the sizes, band and scales, and where dbias goes
BACKWARD_SHAPE_FIELDS = (
    Field("out_stride_m", "i32"), Field("out_stride_h", "i32"), Field("dout_stride_m", "i32"),
    Field("dout_stride_h", "i32"), Field("dq_stride_m", "i32"), Field("dq_stride_h", "i32"),
    Field("dkv_stride_n", "i32"), Field("dkv_stride_h", "i32"), Field("lse_stride_b", "i32"),
    Field("lse_stride_h", "i32"), Field("num_queries", "i32"), Field("num_keys", "i32"), Field("num_heads", "i32"),
    Field("head_dim", "i32"), Field("head_group", "i32"), Field("band_lo", "i32"), Field("band_hi", "i32"),
    Field("band_from_end", "i32"), Field("rows_padded", "i32"), Field("deterministic", "i32"), Field("scale", "f32"),
    Field("scale_log2", "f32"), Field("softcap_in", "f32"), Field("softcap_out", "f32"), Field("dbias_ptr", "ptr"),
    Field("dbias_row_stride", "i64"))

# Both directions' Params end with these (flashgen/dropout.h): the Philox key and counter offset (the
# call's seed and offset, re-filled by every launch of a plan), the keep threshold of 256 and 1 / (1 - p)
DROPOUT_FIELDS = (Field("dropout_seed", "u64"), Field("dropout_offset", "u64"), Field("dropout_keep", "u32"),
                  Field("dropout_scale", "f32"))
