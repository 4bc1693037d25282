"""Launch parameters of the Pallas Mamba-3 SISO kernels, and the static geometry of one call.

Why a separate module: the kernels, the `custom_vjp` wrapper, the glue that pads and permutes the
operands, the benchmark and the tests must all agree on how a call is cut into blocks. Everything here
is static (Python ints and strings), so it is part of the jit cache key.

The chunk length is not a field of `Mamba3ScanConfig`: it is the op's `chunk_size` argument, rounded
by `chunk_length` to a power of two the Triton dots accept (a tuning knob; the result changes only by
rounding).

Padding: headdim P is padded with zeros to a power of two of at least `min_width` (Triton's `tl.dot`
needs every dimension >= 16): Pp.

Kernel layout of d_state: the N dims of queries, keys and states are permuted into contiguous
column pieces of power-of-two widths,
  even  [Sp]  dims 0, 2, ..., 2S-2   (first element of each rotated pair)     columns [0, Sp)
  odd   [Sp]  dims 1, 3, ..., 2S-1   (second element of each rotated pair)    columns [Sp, 2Sp)
  rest        dims 2S .. N-1 (not rotated), then zeros                        columns [2Sp, Np)
with Sp = S rounded up to a power of two >= 8 (zero-padded) and Np = 2Sp + (N - 2S) rounded up to a power
of two >= min_width; the rest columns are cut into power-of-two pieces (one for the benchmark shape (docs/performance.md):
Sp = 32, rest 64, Np = 128). Dot products over d_state do not depend on the order of its dims, so
the chunk kernels use the whole [.., Np] tile; the RoPE rotation of pair a is elementwise between
column a of `even` and of `odd`, which the query/key kernels load and store as column blocks of
their refs (no kernel slices a loaded value), writing every column.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.common.sizes import is_power_of_2, largest_power_of_2_at_most, next_power_of_2, round_up

STORED_STATE_DTYPES = ("float32", "bfloat16", "dot_operand")
QK_GRADIENT_DTYPES = ("float32", "dot_operand", "bfloat16_dots")
ANGLE_SUMS = ("scan", "matmul")
STATE_PASSES = ("split", "walk")


@dataclasses.dataclass(frozen=True)
class Mamba3ScanConfig:
    """Static launch parameters of the Pallas Mamba-3 SISO kernels.

    Attributes:
      state_block_p: headdim rows per program of the two chunk combines of state_passes "split" (their
        grid is batch × heads × headdim/state_block_p; each program walks every chunk of its rows).
      num_warps_state: Triton warps of the chunk combines ("split").
      state_passes: how the states entering every chunk (forward) and the adjoints leaving every chunk
        (backward) are formed (state_passes.py): "walk" (the default since session 23), one launch
        whose programs (batch row, head, walk_block_p headdim rows) form each chunk's contribution with
        one dot inside the walk over the chunks (the contributions never reach HBM, one launch fewer
        per pass; H200: op kernel sum −170 µs at B=32 T=512, −138 µs at B=8 T=2048 with 64 rows); or
        "split", a parallel launch of every chunk's own contribution U_c / R_c (float32
        [Bt, H, nc, Pp, Np] in HBM) and then a combine that walks the chunks.
      walk_block_p, num_warps_walk: headdim rows per program (at most Pp are used) and Triton warps of
        the "walk" launches (64 rows: one program per head, K̃ / Q read once; 32 rows was slower, +93 µs
        at B=32 T=512).
      num_warps_adjoint_walk: Triton warps of the backward's adjoint walk alone, or None for
        num_warps_walk (at 4 warps it needs 255 registers and spills 32 B on its serial chain, at 8
        warps 180 and none, but then one program per SM: triton_inspect.py, Triton 3.6, sm_90; H100,
        session 36: 8 warps 153 → 170 µs per op call, so None).
      num_warps_local: Triton warps of the per-chunk state / adjoint contribution kernels ("split").
      num_warps_chunk: Triton warps of the forward chunk-output kernel.
      num_warps_grad: Triton warps of the backward chunk-gradient kernel(s).
      num_warps_values: Triton warps of the values gradient launch alone (gradient_kernels=3), or None
        for num_warps_grad. At 4 warps it needs 255 registers and spills (triton_inspect.py, Triton 3.6,
        sm_90: 120 B of stack, 8 B with state_dot_with_keys), at 8 warps 181 (144) and none, yet 8 warps
        were slower on an H100 (session 36, with state_dot_with_keys: 320 → 440 µs per op call).
      gradient_kernels: launches the chunk gradients are split into: 1, 2 (dQ apart) or 3 (values dV,
        dZ, dskip / keys dK̃, dADT / queries dQ); see chunk_backward.py.
      num_warps_qk: Triton warps of the forward per-head query/key kernel.
      num_warps_qk_grad: Triton warps of the backward query/key gradient kernel.
      qk_grad_blocks: the query/key gradient kernel cuts each chunk into this many blocks of rows
        (a power of two; blocks of at least 8 rows, 16 with angle_sums "matmul"), one program per block: fewer
        registers per program and more programs in flight. The in-chunk reverse sums of the angle
        gradients are then formed per block, and the blocks after it in the chunk are added by XLA
        (the same sums in another order of the float32 additions).
      qk_gradients_transposed: True: the query/key gradient kernel on [width, rows] tiles
        (qk_gradients_transposed.py): the chunk-gradient launch writes dq, dk̃ position-major, the kernel
        recomputes θ (the forward then stores none), and the sums over a block's rows (bias partials,
        dθ_entry) and the prefix sums of the angles stay inside a warp instead of crossing the 8 warps
        through shared memory. The same sums in another order. Not with bias_gradients_by_xla (whose XLA
        sums read dq, dk̃ row-major): that knob runs the row-major kernel. None (default): on when the
        angles are shared by the heads (the model's case; H100, session 37: train step 73.6 → 71.9 ms
        and 22.6 → 21.5 GiB, no θ stored), and for per-head angles where angle_gradient_pass runs (whole
        chunks per program, no rotate_in_chunk_gradients); other per-head cases keep the row-major
        kernel (its per-head tanh and transposes made the position-major one 414 → 481 µs, session 37).
      transposed_gradient_dots: with the position-major query/key gradients, the chunk-gradient launch
        forms dq, dk̃ transposed by swapping the operands of their dots instead of transposing the
        [L, Np] results before the store (+23 µs per call measured for the latter, session 37).
        H100, session 38: train step 73.1 vs 73.5 ms, within the spread; off.
      stored_theta: with the position-major query/key gradients (for per-head angles only when
        qk_gradients_transposed=True), the forward query/key kernel stores θ
        position-major ([Bt, H, Sp, Tp] float32, each head's [L, Sp] tile transposed before its store)
        and the kernel loads it, instead of recomputing θ from θ_entry (False, the default: no θ
        stored, measured with shared angles, session 37). H200, session 38, per-head angles: the
        kernel 476 → 451 µs with it; off.
      position_major_d_angles: the position-major query/key gradient kernel writes the angles'
        gradient position-major as well (no transpose in the kernel); XLA transposes it back. H200,
        session 38, per-head angles: the kernel 451 → 332 µs (row-major kernel 410), but XLA's
        transposes of the angles in and the gradient out added ~90 µs (kernel sum +27 µs); train
        step (shared angles) unchanged; off.
      angle_gradient_pass: per-head angles only, with the position-major query/key gradient kernel
        (chosen for it when qk_gradients_transposed is None; with qk_gradients_transposed=False the knob
        does nothing) and whole chunks per program: the angles' and DT's gradients are finished by one
        more small kernel (entry_angles.angle_gradients) instead of the gradient kernel and XLA. The
        core then forms the chunk-entry angles itself (entry_angles.chunk_entry_angles inside its
        custom VJP), the forward stores θ position-major (as stored_theta), the gradient kernel reads
        no angles and writes the in-chunk reverse sums of dθ position-major, and the pass adds the
        later chunks' sums, applies the tanh's slope and DT, and writes d angles row-major and d DT:
        no transposes and no angle glue in XLA. H100, session 39, per-head angles, op kernel sum 1902 → 1772 µs at B=8 T=2048 and
        1886 → 1750 at B=32 T=512 (gradient kernel 414 → 266, the pass 57, XLA's angle fusions 87 → 24);
        on (the default).
      num_warps_angle_pass: Triton warps of that kernel.
      entry_prefix_kernel: with the angle gradient pass, the prefix sums of the chunks' angle sums (the
        angle entering each chunk) in one small Pallas launch (entry_angles.entry_angle_prefix) instead
        of XLA's pad, triangular matmul and slices. The same sums in another order. Timed only with
        qk_columns_from_forward (above, a loss together); the launch itself takes 2.0 µs against ~11 µs
        of the XLA ops it replaces. Off.
      bias_gradients_by_xla: the query/key gradient kernel leaves the bias gradients out (their column
        sums over each block's rows are a third of its head loop and 30 of its 43 barriers,
        triton_inspect.py, notes_mamba3_scan.md v15) and XLA forms them from dq, dk̃ and θ in two
        reductions over the batch rows and positions (qk_gradients.bias_gradients; ~300 MB read again
        at the benchmark shape). The same sums in another order. H100, session 36: the kernel
        414 → 297 µs per op call, but XLA's sums (cos and sin of θ, four reductions) ~280: a net loss
        of ~160 µs; off.
      qk_op_order: the query/key kernels read Q, K and their biases in the op's d_state order and the
        gradient kernel writes dQ, dK (in Q's dtype when one program owns a group's heads) and the bias
        gradients in it, the even and odd pieces of the kernel layout (above) as strided column loads
        and stores, where that layout is a pure permutation of d_state (Sp = S, Np = N: S a power of
        two >= 8, N a power of two) and the query/key gradient kernel is the position-major one
        (ScanGeometry.qk_op_order_fits). Removes XLA's permutations of Q, K and the biases into the
        kernel layout and of dQ, dK and the bias gradients out of it (with a group's heads in one
        program, also the float32 dQ, dK and their casts): 8 small launches per op call. The same
        arithmetic on the same values: bit-identical results (checked on an H100 at the benchmark
        shape). H100, session 40, per-head angles, with D per head: op kernel sum 1755 → 1723 µs at
        B=8 T=2048 and 1708 → 1679 at B=32 T=512 (the forward q/k kernel +6 µs for its strided bias
        loads, 25 µs of XLA gone). On by default.
      qk_columns_from_forward: for a backward, the forward query/key kernel also writes Q and K
        position-major ([Bt, G, Np, Tp], each program's [L, Np] tile transposed once before its head
        loop) for the position-major gradient kernel, which then needs no XLA transposes of them (kept
        as the residuals in place of Q, K: same bytes). Needs one program per group (qk_head_splits 1)
        and the position-major gradient kernel (ScanGeometry.qk_columns_from_forward). H100, session
        40, with entry_prefix_kernel (timed only together): the forward kernel +4 µs, XLA's Q, K
        transposes (9 µs) gone, but a 30.7 µs XLA transpose appeared that the default's HLO lacks: op
        kernel sum +14.5 / +25 µs at B=8 T=2048 / B=32 T=512. Off.
      qk_head_splits: the heads of a group are split over this many programs of the query/key kernels
        (the largest divisor of heads-per-group not above it is used): more programs in flight, and
        as many partial group sums of dQ, dK for XLA to add. 1 by default since session 31 (H100, train
        step with the projection kernels: 4 splits 79.4 ms, 2 splits 79.1, 1 split 78.4; the partial
        sums were 48 reductions, ~0.7 ms per step; at B=8 T=2048 the kernels still have 256 programs).
      num_stages: Triton software-pipelining depth of every kernel.
      min_width: smallest padded d_state or headdim (tl.dot needs dims >= 16).
      min_chunk, max_chunk: the range the op's chunk_size is clamped to (powers of two).
      stored_state_dtype: dtype of the per-chunk states and adjoints kept between launches ("float32",
        "bfloat16" as the official kernel stores them, or "dot_operand": the dtype the chunk kernels
        round them to for their dots anyway, i.e. bf16/f16 for 16-bit activations and float32 for
        float32 ones). The running states, the chunks' contributions and the final state are float32
        either way; only ⟨S_c, dS_c⟩ in dADT reads the stored states outside a dot.
      angle_sums: how the query/key kernels form the in-chunk prefix sums of the angle increments
        (forward) and the reverse sums of the angle gradients (backward): "scan" (Triton's cumsum,
        a scan across the program's warps) or "matmul" (a [L, L] triangular 0/1 matrix times the
        [L, Sp] tile, exact float32 products: the same sums up to the order of the additions). The
        matmul form needs Sp >= min_width (tl.dot's smallest dimension); narrower angle pieces use the scan.
      qk_gradient_dtype: dtype of the per-head gradients dq, dk̃ ([Bt, Tp, H, Np]) that the chunk-gradient
        launches write and the query/key gradient kernel reads: "float32"; "dot_operand" (bf16/f16
        for 16-bit activations, as the official kernels store them; float32 otherwise); or
        "bfloat16_dots" (the default: bf16 when the dots are bf16, float32 otherwise, since float16's
        range could overflow on loss-scaled gradients). 16 bits halve the bytes of the two largest
        backward intermediates, for one rounding of each per-head gradient before the rotation back
        and the float32 sums over a group's heads and over positions (H200, session 17: op fwd+bwd
        −0.03 to −0.08 ms, train step 88.1 → 86.4 ms).
      stored_scores: the forward chunk-output kernel also writes each chunk's masked scores
        (Q·K̃ᵀ) ⊙ Λ ([L, L] per chunk and head, in the dot operand dtype, the rounding the backward's
        dV dot applies to them anyway) and the values gradient launch reads them instead of forming
        them again (one dot and the [L, L] decay matrix fewer; + Bt·Tp·H·L elements of memory per call
        kept for the backward). Needs gradient_kernels=3 (the keys launch forms its float32 scores).
      stored_ungated: with Z, the forward also writes the ungated output Y (float32, [Bt, Tp, H, Pp])
        and the values launch reads it for dZ instead of recomputing it (two dots fewer, and with
        stored_scores no Q or state read at all); no effect without Z. Needs gradient_kernels=3.
      stored_for_keys: the keys gradient launch reads them too (needs stored_scores; the scores are then
        kept in float32, since that launch multiplies them elementwise with ⟨dY_i, v_j⟩ in float32): no
        Q·K̃ᵀ dot, and with the ungated Y no Q·S_cᵀ dot either, since e^{cs_i}⟨dY_i, (Q S_cᵀ)_i⟩ =
        ⟨dY_i, Y_i⟩ − Σ_j M_ij − skip_i⟨dY_i, v_i⟩ (docs/mamba3_siso.md §4.4 step 2). One more
        Bt·Tp·H·L float32 scores kept instead of the 16-bit ones.
      adt_in_values: when the scores and the ungated Y are both stored (stored_scores, stored_ungated,
        and a Z: Y is kept only then), the values launch forms dADT from them (one more dot there,
        A = dY·Vᵀ; ⟨v_i, dS k̃_i⟩ from its K̃·dSᵀ) and the keys launch only dK̃ (no scores, no state, no
        reductions): M = scores ⊙ A then uses the stored scores, rounded to the dot operand dtype
        unless stored_for_keys keeps them in float32. Otherwise dADT stays in the keys launch. H200,
        session 17: op fwd+bwd −0.15 to −0.18 ms, train step 88.0 → 84.2 ms.
      keys_with_queries: with gradient_kernels=3 (the default; set it False with 1 or 2), the keys and
        queries gradients in one launch (the values launch apart): A = dY·Vᵀ, the decay matrix and dY
        formed once for dK̃ and dQ, one launch fewer. H100, session 36 (per-head angles, µs per op call,
        B=8 T=2048 / B=32 T=512): keys 181 / 182 + queries 178 / 178 → one launch 311 / 312, and with
        state_dot_with_keys the values launch 389 / 388 → 320 / 321; train step 76.0 → 73.4 ms.
      state_dot_with_keys: with keys_with_queries and the values launch forming dADT (adt_in_values
        with its conditions), the keys+queries launch, which loads the chunk's entering state S_c and
        the adjoint dS of the state leaving it anyway, also writes the chunk's ρ_S = e^{cs_end}⟨S_c, dS⟩
        ([Bt, nc, H] float32; it then runs before the values launch), and the values launch reads that
        scalar instead of S_c (Pp·Np elements fewer per program, ~15% of its bytes, and no [Pp, Np]
        product and reduction). No effect otherwise.
      rotate_in_chunk_gradients: the queries' and keys' chunk gradients and their rotation back (bias,
        scale, angle and skip-term gradients) in launches of one program per (batch row, chunk, head)
        (head_gradients.py; head_gradient_launches), instead of the keys / queries launches plus the query/key gradient kernel
        that walks a group's heads serially. Applies when the values launch forms dADT
        (adt_in_values with its conditions) and every column piece of the kernel layout is at least
        min_width wide; otherwise the separate launches run (the same sums). Off by default: slower on
        the H200 (session 22: backward kernel sum +0.29 ms at B=32 T=512; head_gradients.py).
      head_gradient_launches: that work in 1 launch, or 2 (the queries' side dx̄ and the keys' side dȳ,
        ds apart, each with its share of the angle gradients, which XLA adds: fewer live tiles per
        program, A = dY·Vᵀ formed twice).
      num_warps_head_grad: Triton warps of that launch (or those two).
      skip_in_scores: the skip term's γ⟨q̄, k̄⟩·V as the diagonal of the chunk kernels' scores (the masked
        decay matrix carries γ/s on its diagonal, since ⟨q_i, k̃_i⟩ = s_i⟨q̄_i, k̄_i⟩), as the official
        kernels do, instead of a float32 per-position weight of V: its q, k̃ gradients then come through
        the chunk-gradient dots, and the query/key gradient kernel adds no γ·d skip terms. The term is
        then formed from the dot operands (bf16 for bf16 activations) instead of float32. The default
        since session 23 (H200, B=32 T=512 per-head angles: query/key gradient kernel 500 → 408 µs,
        op kernel sum 2157 → 2054 µs; benchmarks/notes_mamba3_scan.md v14); False keeps the float32
        per-position weight D + γ⟨q̄, k̄⟩ of V.
      fast_rotation: the query/key kernels' cos θ and sin θ (forward rotation, its transpose and the
        angle gradient) from the hardware's cos.approx / sin.approx on θ − π (θ is wrapped into
        [0, 2π) before: about 2^-21 absolute error, against ~1 ulp from libdevice, far below the bf16
        rounding of q, k̃) instead of libdevice's cos / sin, whose range reduction keeps a slow path
        with a local-memory table: 48 local loads and 32 stores per head step of the forward
        query/key kernel and of the query/key gradient kernel (Triton 3.6 for sm_90,
        benchmarks/triton_inspect.py; that slow path never runs for wrapped angles, so the static
        counts overstate libdevice's cost). Timed on an H100 (session 26, B=8 T=2048 and B=32 T=512,
        per-head angles): the forward query/key kernel 259 → 205 µs, but the query/key gradient
        kernel 417 → 530 µs, so the op is +60 µs and the train step +1.3 ms with it on in both
        kernels. On by default since 2026-12-06 for the forward only (fast_rotation_backward).
      fast_math: the kernels' transcendental functions from the hardware's ex2 and rcp instead of
        libdevice's expf and full divisions: the output gate's σ(Z) (the forward's chunk outputs, the
        adjoint walk, the chunk-gradient launches; common/inline_ptx.fast_sigmoid, ~4e-6 relative) and
        the within-chunk decays e^x as 2^(x·log2 e) (chunk_math.ChunkDecay: ~|x|·1e-7 relative), far
        below the bf16 rounding of the operands. In the interpreter the same formulas in float32.
        triton_inspect.py (Triton 3.6, sm_90, B=8 T=2048): notes_mamba3_scan.md v25. Untimed; off by
        default.
      fast_rotation_backward: the same choice for the backward's rotations (the query/key gradient
        kernel, or the head gradient launches with rotate_in_chunk_gradients); None follows
        fast_rotation. The default, fast_rotation=True with fast_rotation_backward=False, takes the
        forward's gain alone; the backward rotates with libdevice's cos / sin of the same θ, about
        2^-21 from the forward's. H100 (session 27, B=8 T=2048, per-head angles): the forward
        query/key kernel 265 → 204 µs, kernel sum 2125 → 2064 µs, train step 82.1 → 80.9 ms; GPU
        tests (shared and per-head angles) passed.
      fuse_qk_norm: when the op is given the B/C norms (`mamba3_siso_scan(..., qk_norm=...)`, as the
        Mamba-3 mixer's composition path does), normalize Q and K inside the layout step (qk_norm.py: one kernel forward,
        one backward, in place of the norms' and the layout's XLA passes both ways); False normalizes
        them with `jmamba.ops.rms_norm` first and keeps the XLA layout step (as before 2026-12-06,
        session 29). Off: its GPU tests pass (H100, session 30), but alone it does not pay (the op
        forward 0.645 -> 0.718 ms, fwd+bwd 2.246 -> 2.243 ms at the benchmark layer, bench_mamba3_projection.py).
      fuse_projection: `mamba3_siso_scan_projected` (the Mamba-3 mixer's call) runs the per-position
        work between in_proj's rest block and the core (the B/C norms and layout, A, DT, ADT, the
        trapezoid weights, the angles; backward d rest in one write) as projection.py's two kernels;
        False runs it as XLA ops around `mamba3_siso_scan` (with fuse_qk_norm for the norms). On by
        default since session 31: the first version (a loop over heads of [L] columns) cost 3.2 ms per
        step and saved 2.6 (H100, session 30: the backward kernel 93 µs per layer, latency-bound); with
        the heads as one [L, HP] block the kernels are 24 + 10 µs per layer and the train step went
        82.5 -> 80.0 ms (H100, session 31, 2 row splits; GPU tests passed; notes_mamba3_scan.md v20).
      projection_row_splits: programs per chunk of the projection kernels (a power of two; each takes
        chunk / splits rows, at least 1): more, smaller programs (fewer registers each, more of them per
        SM) for the same values. The weight-gradient partials are per program, summed in a fixed order.
        2 by default (H100, session 31, train step: 1 split 80.5 ms, 2 splits 80.0, 4 splits with 2 / 4
        warps 79.7 and 79.9 in two calls against 80.0 and 79.8: a tie; 2 keeps the default warps).
      num_warps_projection, num_warps_projection_grad: Triton warps of the projection forward / backward
        kernels (4 / 8: the backward holds a group's x̂, g and dy [rows, N] of B and of C in turn).
    """

    state_block_p: int = 16
    num_warps_state: int = 4
    state_passes: str = "walk"
    walk_block_p: int = 64
    num_warps_walk: int = 4
    num_warps_adjoint_walk: int | None = None
    num_warps_local: int = 4
    num_warps_chunk: int = 4
    num_warps_grad: int = 4
    num_warps_values: int | None = None
    gradient_kernels: int = 3
    num_warps_qk: int = 8
    num_warps_qk_grad: int = 8
    qk_grad_blocks: int = 1
    bias_gradients_by_xla: bool = False
    qk_gradients_transposed: bool | None = None
    transposed_gradient_dots: bool = False
    stored_theta: bool = False
    position_major_d_angles: bool = False
    angle_gradient_pass: bool = True
    num_warps_angle_pass: int = 4
    entry_prefix_kernel: bool = False
    qk_op_order: bool = True
    qk_columns_from_forward: bool = False
    qk_head_splits: int = 1
    num_stages: int = 1
    min_width: int = 16
    min_chunk: int = 16
    max_chunk: int = 128
    stored_state_dtype: str = "dot_operand"
    qk_gradient_dtype: str = "bfloat16_dots"
    angle_sums: str = "scan"
    stored_scores: bool = True
    stored_ungated: bool = True
    stored_for_keys: bool = False
    adt_in_values: bool = True
    keys_with_queries: bool = True
    state_dot_with_keys: bool = True
    rotate_in_chunk_gradients: bool = False
    head_gradient_launches: int = 2
    num_warps_head_grad: int = 4
    skip_in_scores: bool = True
    fast_rotation: bool = True
    fast_rotation_backward: bool | None = False
    fast_math: bool = False
    fuse_qk_norm: bool = False
    fuse_projection: bool = True
    projection_row_splits: int = 2
    num_warps_projection: int = 4
    num_warps_projection_grad: int = 8

    def validate(self) -> "Mamba3ScanConfig":
        for name in ("state_block_p", "walk_block_p", "num_warps_walk", "num_warps_state", "num_warps_local", "num_warps_chunk", "num_warps_grad",
                     "num_warps_qk", "num_warps_qk_grad", "num_warps_head_grad", "num_warps_angle_pass", "qk_grad_blocks", "min_width", "min_chunk",
                     "max_chunk", "projection_row_splits", "num_warps_projection", "num_warps_projection_grad"):
            v = getattr(self, name)
            if not is_power_of_2(v):
                raise ValueError(f"Mamba3ScanConfig.{name} must be a positive power of two, got {v!r}")
        for name in ("min_width", "min_chunk"):
            if getattr(self, name) < 16:
                raise ValueError(f"Mamba3ScanConfig.{name} must be >= 16 (Triton's dots need every dimension >= 16), "
                                 f"got {getattr(self, name)!r}")
        for name in ("num_warps_state", "num_warps_walk", "num_warps_local", "num_warps_chunk", "num_warps_grad", "num_warps_qk",
                     "num_warps_qk_grad", "num_warps_head_grad", "num_warps_projection", "num_warps_projection_grad",
                     "num_warps_angle_pass"):
            if getattr(self, name) > 32:
                raise ValueError(f"Mamba3ScanConfig.{name} must be <= 32 (Triton's limit), got {getattr(self, name)!r}")
        for name in ("num_warps_values", "num_warps_adjoint_walk"):
            v = getattr(self, name)
            if v is not None and (not is_power_of_2(v) or v > 32):
                raise ValueError(f"Mamba3ScanConfig.{name} must be None or a power of two <= 32, got {v!r}")
        if self.min_chunk > self.max_chunk:
            raise ValueError(f"Mamba3ScanConfig.min_chunk ({self.min_chunk}) must be <= max_chunk ({self.max_chunk})")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"Mamba3ScanConfig.num_stages must be a positive int, got {self.num_stages!r}")
        if isinstance(self.qk_head_splits, bool) or not isinstance(self.qk_head_splits, int) or self.qk_head_splits < 1:
            raise ValueError(f"Mamba3ScanConfig.qk_head_splits must be a positive int, got {self.qk_head_splits!r}")
        if type(self.head_gradient_launches) is not int or self.head_gradient_launches not in (1, 2):
            raise ValueError(f"Mamba3ScanConfig.head_gradient_launches must be 1 or 2, got {self.head_gradient_launches!r}")
        if type(self.gradient_kernels) is not int or self.gradient_kernels not in (1, 2, 3):
            raise ValueError(f"Mamba3ScanConfig.gradient_kernels must be 1, 2 or 3, got {self.gradient_kernels!r}")
        if self.state_passes not in STATE_PASSES:
            raise ValueError(f"Mamba3ScanConfig.state_passes must be one of {STATE_PASSES}, got {self.state_passes!r}")
        if self.walk_block_p < 16:
            raise ValueError(f"Mamba3ScanConfig.walk_block_p must be >= 16 (the walk's dot has walk_block_p rows), "
                             f"got {self.walk_block_p!r}")
        if self.angle_sums not in ANGLE_SUMS:
            raise ValueError(f"Mamba3ScanConfig.angle_sums must be one of {ANGLE_SUMS}, got {self.angle_sums!r}")
        if self.stored_state_dtype not in STORED_STATE_DTYPES:
            raise ValueError(f"Mamba3ScanConfig.stored_state_dtype must be one of {STORED_STATE_DTYPES}, "
                             f"got {self.stored_state_dtype!r}")
        if self.qk_gradient_dtype not in QK_GRADIENT_DTYPES:
            raise ValueError(f"Mamba3ScanConfig.qk_gradient_dtype must be one of {QK_GRADIENT_DTYPES}, "
                             f"got {self.qk_gradient_dtype!r}")
        if self.stored_for_keys is True and not self.stored_scores:
            raise ValueError("Mamba3ScanConfig.stored_for_keys=True needs stored_scores=True")
        for name in ("adt_in_values", "keys_with_queries", "state_dot_with_keys", "bias_gradients_by_xla", "transposed_gradient_dots", "stored_theta",
                     "position_major_d_angles", "angle_gradient_pass", "qk_op_order", "qk_columns_from_forward", "entry_prefix_kernel", "rotate_in_chunk_gradients", "skip_in_scores",
                     "fast_rotation", "fast_math", "fuse_qk_norm", "fuse_projection"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"Mamba3ScanConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.qk_gradients_transposed is not None and type(self.qk_gradients_transposed) is not bool:
            raise ValueError("Mamba3ScanConfig.qk_gradients_transposed must be None, True or False, got "
                             f"{self.qk_gradients_transposed!r}")
        if self.fast_rotation_backward is not None and type(self.fast_rotation_backward) is not bool:
            raise ValueError("Mamba3ScanConfig.fast_rotation_backward must be True, False or None (follow "
                             f"fast_rotation), got {self.fast_rotation_backward!r}")
        if self.keys_with_queries and self.gradient_kernels != 3:
            raise ValueError(f"Mamba3ScanConfig.keys_with_queries=True needs gradient_kernels=3, "
                             f"got gradient_kernels={self.gradient_kernels}")
        for name in ("stored_scores", "stored_ungated", "stored_for_keys"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"Mamba3ScanConfig.{name} must be True or False, got {getattr(self, name)!r}")
            if getattr(self, name) and self.gradient_kernels != 3:
                raise ValueError(f"Mamba3ScanConfig.{name}=True needs gradient_kernels=3 (the values gradients in "
                                 f"their own launch), got gradient_kernels={self.gradient_kernels}: pass "
                                 f"stored_scores=False, stored_ungated=False with 1 or 2 gradient launches")
        return self


# Frozen default for the benchmark shape (docs/performance.md) (H=24, P=64, N=128, chunk 64), from the H200 sweeps and the
# register / spill / barrier counts in benchmarks/notes_mamba3_scan.md: 4 warps for the dot kernels
# (2 CTAs per SM), chunk gradients in three launches (the one- and two-launch kernels spill), chunk
# states stored in the dot operand dtype, 8 warps for the query/key kernels (no spills), the masked
# scores and the ungated Y kept for the values gradient launch (fwd+bwd 2.99 -> 2.69 ms at B=8 T=2048,
# train step 94.8 -> 87.7 ms for +3.4 GiB; session 16), not for the keys launch (no gain: its float32
# scores slow the values launch and the forward as much as they speed the keys launch); dq, dk̃ between
# the chunk-gradient launches and the query/key gradient kernel in bf16 when the dots are, and dADT
# formed by the values launch from the stored products (session 17); the skip term's γ⟨q̄, k̄⟩ as the
# scores' diagonal and the state passes walking the chunks with their contributions' dots inside, 64
# headdim rows per program (session 23, separate calls: train step 83.8–85.5 -> 76.8–77.9 ms).
DEFAULT_CONFIG = Mamba3ScanConfig()


def chunk_length(chunk_size: int, seqlen: int, config: Mamba3ScanConfig) -> int:
    """The chunk the kernels use: a power of two in [min_chunk, max_chunk], at most chunk_size
    (rounded down) and no longer than the sequence needs."""
    want = min(largest_power_of_2_at_most(max(int(chunk_size), 1)), next_power_of_2(seqlen))
    return max(config.min_chunk, min(config.max_chunk, want))


@dataclasses.dataclass(frozen=True)
class ScanGeometry:
    """Static description of one (padded, permuted) call, shared by its forward and backward kernels.

    Attributes:
      batch, seqlen, heads, groups, headdim, d_state, num_angles: the call's Bt, T, H, G, P, N, S.
      chunk: chunk length L (power of two); padded_seqlen: T rounded up to a multiple of L.
      padded_headdim: Pp, P rounded up to a power of two >= min_width.
      angle_width: Sp, the padded width of the even / odd pieces (0 when S = 0).
      padded_state: Np, 2·Sp + (N − 2S) rounded up to a power of two >= min_width.
      has_z: the output is gated by silu(Z).
      matmul_dtype: operand dtype of the in-kernel dots ("bfloat16"/"float16" for 16-bit
        activations: tensor cores with float32 accumulation; "float32": exact float32 dots).
      io_dtype: dtype of V / Z / out.
      config: the launch parameters.
      interpret: run the kernels in the Pallas interpreter (CPU).
      shared_angles: the raw angles are shared by the heads ([Bt, T, 1, S], the model's case).
      qk_op_order: Q, K, their biases and gradients cross the kernels in the op's d_state order
        (config.qk_op_order where `qk_op_order_fits`; set by the caller that passes them so, scan.py).
    """

    batch: int
    seqlen: int
    heads: int
    groups: int
    headdim: int
    d_state: int
    num_angles: int
    chunk: int
    padded_seqlen: int
    padded_headdim: int
    angle_width: int
    padded_state: int
    has_z: bool
    matmul_dtype: str
    io_dtype: str
    config: Mamba3ScanConfig
    interpret: bool = False
    shared_angles: bool = False
    qk_op_order: bool = False

    @property
    def n_chunks(self) -> int:
        return self.padded_seqlen // self.chunk

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    @property
    def qk_splits(self) -> int:
        """Programs sharing the heads of one group in the query/key kernels (divides heads_per_group)."""
        hpg = self.heads_per_group
        return max(d for d in range(1, min(self.config.qk_head_splits, hpg) + 1) if hpg % d == 0)

    @property
    def qk_op_order_fits(self) -> bool:
        """Whether Q, K can cross the query/key kernels in the op's d_state order (config.qk_op_order):
        the kernel layout is a pure permutation of d_state (no padding of the even / odd pieces or of
        the rest) and the only kernels that read Q, K are the forward query/key kernel and the
        position-major gradient kernel (not the row-major one, the rotation in the chunk-gradient
        launches or XLA's bias sums)."""
        S, N = self.num_angles, self.d_state
        return (self.config.qk_op_order and S > 0 and self.angle_width == S and self.padded_state == N
                and self.qk_grad_position_major and not self.config.rotate_in_chunk_gradients)

    @property
    def qk_columns_from_forward(self) -> bool:
        """config.qk_columns_from_forward where it applies: one program per group in the query/key kernels
        and the position-major gradient kernel (the chunk launches not rotating back)."""
        return (self.config.qk_columns_from_forward and self.qk_splits == 1 and self.qk_grad_position_major
                and not self.config.rotate_in_chunk_gradients)

    @property
    def qk_grad_position_major(self) -> bool:
        """Whether the query/key gradient kernel runs on position-major tiles: config.qk_gradients_transposed,
        or when that is None, angles shared by the heads (the measured case); never with
        config.bias_gradients_by_xla (whose XLA sums read dq, dk̃ row-major)."""
        if self.config.bias_gradients_by_xla:
            return False
        if self.config.qk_gradients_transposed is None:
            return self.num_angles > 0 and (self.shared_angles or self.angle_pass_fits)
        return self.config.qk_gradients_transposed

    @property
    def angle_pass_fits(self) -> bool:
        """config.angle_gradient_pass with per-head angles and a layout it runs on: the query/key gradient
        kernel on whole chunks, no rotation in the chunk-gradient launches (whether the kernel is
        position-major aside)."""
        return (self.config.angle_gradient_pass and self.num_angles > 0 and not self.shared_angles
                and self.qk_grad_rows == self.chunk and not self.config.rotate_in_chunk_gradients)

    @property
    def theta_position_major(self) -> bool:
        """Whether the forward stores θ position-major for the position-major query/key gradient kernel
        (config.stored_theta, or the angle gradient pass; never with rotate_in_chunk_gradients, whose
        launch reads θ row-major)."""
        return (self.qk_grad_position_major and (self.config.stored_theta or self.angle_pass)
                and self.num_angles > 0 and not self.config.rotate_in_chunk_gradients)

    @property
    def angle_pass(self) -> bool:
        """config.angle_gradient_pass where it applies: per-head angles, the position-major query/key
        gradient kernel on whole chunks, no rotation in the chunk-gradient launches."""
        return self.angle_pass_fits and self.qk_grad_position_major

    @property
    def qk_grad_rows(self) -> int:
        """Rows per program of the query/key gradient kernel: chunk / qk_grad_blocks, at least 8 (at
        least min_width with the angle sums by matmul: tl.dot's smallest dimension) and at most the chunk."""
        least = self.config.min_width if self.angle_sums_by_matmul else 8
        return min(self.chunk, max(self.chunk // self.config.qk_grad_blocks, least))

    @property
    def angle_sums_by_matmul(self) -> bool:
        """config.angle_sums == "matmul" and the angle pieces wide enough for tl.dot."""
        return self.config.angle_sums == "matmul" and self.angle_width >= self.config.min_width

    @property
    def rest_width(self) -> int:
        """Columns after the rotated pieces: the N − 2S unrotated dims, then zeros."""
        return self.padded_state - 2 * self.angle_width

    @property
    def pieces(self) -> tuple[tuple[str, int, int], ...]:
        """(name, first column, width) of the column pieces covering the kernel layout [0, Np): even,
        odd, then the rest cut into powers of two (largest first)."""
        Sp = self.angle_width
        out = [("even", 0, Sp), ("odd", Sp, Sp)] if Sp else []
        start, left = 2 * Sp, self.rest_width
        while left:
            width = largest_power_of_2_at_most(left)
            out.append((f"rest{start}", start, width))
            start, left = start + width, left - width
        return tuple(out)

    @property
    def state_block_p(self) -> int:
        return min(self.config.state_block_p, self.padded_headdim)

    @property
    def walk_block_p(self) -> int:
        return min(self.config.walk_block_p, self.padded_headdim)

    @property
    def qk_gradient_dtype(self):
        """dtype of dq, dk̃ between the chunk-gradient launches and the query/key gradient kernel."""
        choice, mm = self.config.qk_gradient_dtype, jnp.dtype(self.matmul_dtype)
        if choice == "dot_operand" or (choice == "bfloat16_dots" and mm == jnp.bfloat16):
            return mm
        return jnp.dtype("float32")

    @property
    def stored_state_dtype(self):
        stored = self.config.stored_state_dtype
        return jnp.dtype(self.matmul_dtype if stored == "dot_operand" else stored)


def make_geometry(*, batch, seqlen, heads, groups, headdim, d_state, num_angles, chunk_size, has_z,
                  matmul_dtype, io_dtype, config: Mamba3ScanConfig | None = None,
                  interpret: bool = False, shared_angles: bool = False) -> ScanGeometry:
    """The static plan of a call (see ScanGeometry); `config` None means DEFAULT_CONFIG."""
    if config is not None and not isinstance(config, Mamba3ScanConfig):
        raise TypeError(f"config must be a Mamba3ScanConfig or None, got {type(config).__name__}")
    cfg = (config or DEFAULT_CONFIG).validate()
    L = chunk_length(chunk_size, seqlen, cfg)

    def width(n, least=cfg.min_width):
        return 0 if n == 0 else max(least, next_power_of_2(n))

    angle_width = width(num_angles, 8)

    return ScanGeometry(
        batch=batch, seqlen=seqlen, heads=heads, groups=groups, headdim=headdim, d_state=d_state,
        num_angles=num_angles, chunk=L, padded_seqlen=round_up(seqlen, L),
        padded_headdim=width(headdim), angle_width=angle_width,
        padded_state=width(2 * angle_width + d_state - 2 * num_angles),
        has_z=bool(has_z), matmul_dtype=jnp.dtype(matmul_dtype).name, io_dtype=jnp.dtype(io_dtype).name,
        config=cfg, interpret=bool(interpret), shared_angles=bool(shared_angles))
