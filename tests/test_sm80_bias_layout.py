"""Where the Ampere bias instances read their bias, checked on the host against CuTe's own partitions.

The kernels load a bias tile into shared memory and read it back with ldmatrix straight into the
register layout of S (forward) or S^T (backward), by lane addresses the headers compute by hand
(``FwdKernel::bias_row_key``, ``BwdKernel::bias_chunk``, ``bias_slot``, ``bias_read``).  A host program
compiled from the same headers replays each ldmatrix (which lane's address feeds which register,
PTX's rule) for every thread of each default bias instance and compares the (row, key) each
accumulator register receives with what CuTe's ``partition_C`` of an identity tensor says that
register holds; it also checks that a backward warp's bias slots are exactly the dS^T slots its own
stores write (so no warp overwrites a bias value another has yet to read), that every ldmatrix
address is a whole 16-byte slot whose 8 rows fall in 8 different bank groups, and that the dbias
stores' register pairs are neighbouring keys.  No GPU needed: a wrong mapping fails here.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flashgen.build.graph import include_dirs
from flashgen.spec.sm80_bwd import Sm80Bwd
from flashgen.spec.sm80_fwd import Sm80Fwd
from flashgen.toolchain import probe_toolchain

pytestmark = pytest.mark.nvcc

# one dtype suffices: the layouts do not depend on it
FORWARD = [k for k in Sm80Fwd.default_set() if k.bias and k.dtype == "f16"]
BACKWARD = [k for k in Sm80Bwd.default_set() if k.bias and k.dtype == "f16"]

PROBE = r"""
#include <cstdio>
#include <map>
#include <set>
#include <utility>
#include "flashgen/sm80_fwd.h"
#include "flashgen/sm80_bwd.h"
using namespace cute;

static int failures = 0;
static void expect(bool ok, char const* name, char const* what, int tid, int a, int b) {
  if (!ok && ++failures < 20) printf("FAIL %s: %s (thread %d: %d %d)\n", name, what, tid, a, b);
}

// a 16-byte slot of a layout: 8 contiguous elements from an offset that is a multiple of 8
template <class Layout>
static bool whole_slot(Layout const& layout, int row, int col) {
  int const at = layout(row, col);
  bool ok = at % 8 == 0;
  for (int e = 0; e < 8; ++e) ok = ok && layout(row, col + e) == at + e;
  return ok;
}

// the 8 row addresses of each of an ldmatrix.x4's matrices (lanes 8i .. 8i + 7) in 8 different bank groups
static bool conflict_free(int const (&offsets)[32]) {
  for (int i = 0; i < 4; ++i) {
    std::set<int> groups;
    for (int r = 0; r < 8; ++r) groups.insert(offsets[8 * i + r] / 8 % 8);
    if (groups.size() != 8) return false;
  }
  return true;
}

template <class K>
static void forward(char const* name) {
  typename K::TiledMma mma;
  typename K::SmemLayoutBias layout;
  for (int tid = 0; tid < K::kThreads; ++tid) {
    int const warp = tid / 32, lane = tid % 32;
    auto coord = mma.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<K::kBlockM>, Int<K::kBlockN>>{}));
    for (int m = 0; m < size<1>(coord); ++m) {
      for (int j = 0; j < size<2>(coord) / 2; ++j) {
        int offsets[32];
        for (int l = 0; l < 32; ++l) {
          auto const [row, key] = K::bias_row_key(warp, l, m, j);
          offsets[l] = layout(row, key);
          expect(whole_slot(layout, row, key), name, "ldmatrix row is a 16-byte slot", tid, row, key);
        }
        expect(conflict_free(offsets), name, "ldmatrix rows in 8 bank groups", tid, m, j);
        for (int i = 0; i < 4; ++i) {
          for (int h = 0; h < 2; ++h) {  // matrix i's row lane / 4 (that lane's address), column 2 (lane % 4) + h
            auto const [row, key] = K::bias_row_key(warp, 8 * i + lane / 4, m, j);
            auto const want = coord(make_coord(make_coord(h, i % 2), m, 2 * j + i / 2));
            expect(get<0>(want) == row, name, "row", tid, get<0>(want), row);
            expect(get<1>(want) == key + 2 * (lane % 4) + h, name, "key", tid, get<1>(want), key + 2 * (lane % 4) + h);
          }
        }
      }
    }
  }
  printf("checked %s\n", name);
}

template <class K>
static void backward(char const* name) {
  typename K::TiledMmaKeys mma;
  typename K::SmemLayoutDsT layout;
  for (int warp = 0; warp < K::kWarps; ++warp) {
    std::set<std::pair<int, int>> loaded, stored;  // dS^T slots (key, first query) of the warp
    std::map<std::pair<int, int>, std::pair<int, int>> holds;  // slot -> the (query, first key) of its bias
    for (int c = 0; c < K::kBiasChunksPerWarp; ++c) {
      auto const [query, key8] = K::bias_chunk(warp, c);
      auto const [key, query8] = K::bias_slot(query, key8);
      expect(key8 % 8 == 0 && whole_slot(layout, key, query8), name, "bias chunk in a 16-byte slot", warp, key, query8);
      expect(loaded.insert({key, query8}).second, name, "one chunk per slot", warp, key, query8);
      holds[{key, query8}] = {query, key8};
    }
    for (int lane = 0; lane < 32; ++lane) {
      int const tid = 32 * warp + lane;
      auto thr = mma.get_thread_slice(tid % K::kKeyThreads);
      auto coord = flashgen::sm80::rows_cols(thr.partition_C(
          make_identity_tensor(Shape<Int<K::kBlockN>, Int<K::kQueryChunk>>{})));  // (key, query in the chunk)
      int const query0 = tid / K::kKeyThreads * K::kQueryChunk;
      for (int r = 0; r < size<0>(coord); ++r)
        for (int c = 0; c < size<1>(coord); ++c) {
          int const q = query0 + get<1>(coord(r, c));
          stored.insert({get<0>(coord(r, c)), q - q % 8});
        }
      for (int m = 0; m < K::kKeysPerWarp / 16; ++m) {
        for (int j = 0; j < K::kQueryChunk / 16; ++j) {
          int offsets[32];
          for (int l = 0; l < 32; ++l) {
            auto const [key, query8] = K::bias_read(warp, l, m, j);
            offsets[l] = layout(key, query8);
            expect(loaded.count({key, query8}) == 1, name, "reads a slot the warp loaded", tid, key, query8);
          }
          expect(conflict_free(offsets), name, "ldmatrix rows in 8 bank groups", tid, m, j);
          for (int i = 0; i < 4; ++i) {
            for (int h = 0; h < 2; ++h) {  // transposed: matrix i's rows 2 (lane % 4) + h, column lane / 4
              auto const [slot_key, slot_query] = K::bias_read(warp, 8 * i + 2 * (lane % 4) + h, m, j);
              auto const [query, key8] = holds[{slot_key, slot_query}];  // that row: the slot's 8 keys
              int const key = key8 + lane / 4;
              auto const want = coord(i % 2 + 2 * m, h + 2 * (2 * j + i / 2));
              expect(get<0>(want) == key, name, "key", tid, get<0>(want), key);
              expect(query0 + get<1>(want) == query, name, "query", tid, query0 + get<1>(want), query);
            }
          }
        }
      }
    }
    expect(loaded == stored, name, "the warp's bias slots are its own dS^T slots", warp, int(loaded.size()),
           int(stored.size()));
  }
  typename K::TiledMmaDq dq;
  for (int tid = 0; tid < 32 * K::kDqRowWarps; ++tid) {  // the dbias stores: pairs of neighbouring keys
    auto coord = dq.get_thread_slice(tid).partition_A(make_identity_tensor(Shape<Int<K::kBlockM>, Int<K::kBlockN>>{}));
    for (int mm = 0; mm < size<1>(coord); ++mm)
      for (int kk = 0; kk < size<2>(coord); ++kk)
        for (int e = 0; e < size<0>(coord); e += 2) {
          auto const a = coord(e, mm, kk), b = coord(e + 1, mm, kk);
          expect(get<0>(a) == get<0>(b) && get<1>(a) % 2 == 0 && get<1>(b) == get<1>(a) + 1, name, "dbias pair", tid,
                 get<0>(a), get<1>(a));
        }
  }
  printf("checked %s\n", name);
}

int main() {
%(calls)s
  printf("failures %d\n", failures);
  return failures != 0;
}
"""


def test_bias_fragments_match_cutes_partitions(tmp_path: Path):
    report = probe_toolchain()
    if not report.ok():
        pytest.skip("no complete toolchain")
    tc = report.toolchain()
    assert FORWARD and BACKWARD, "the default sets have bias instances"
    calls = [f'  forward<{k.cpp_type}>("{k.name}");' for k in FORWARD]
    calls += [f'  backward<{k.cpp_type}>("{k.name}");' for k in BACKWARD]
    src = tmp_path / "probe.cu"
    src.write_text(PROBE.replace("%(calls)s", "\n".join(calls)))
    exe = tmp_path / "probe"
    build = subprocess.run([str(tc.nvcc), "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG",
                            *(f"-I{d}" for d in include_dirs(tc)), "-o", str(exe), str(src)],
                           capture_output=True, text=True)
    assert build.returncode == 0, f"the probe did not compile:\n{build.stderr[-4000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and "failures 0" in run.stdout, run.stdout[-4000:]
    for k in FORWARD + BACKWARD:
        assert f"checked {k.name}" in run.stdout
