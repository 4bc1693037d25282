"""Block sizes and launch parameters of the Pallas selective-scan kernels (one frozen dataclass).

Why a separate module: the kernels, the custom_vjp wrapper, the benchmark and the tests all need to
agree on how a call is tiled, and the benchmark sweeps these values on the GPU. Everything here is
static (Python ints), so it becomes part of the jit cache key.

Tiling (see `scan.py` for the algorithm):
  * `block_d` channels per program; the state of a program is an `[n, block_d]` float32 tile held in
    registers (n = d_state padded to a power of two).
  * `chunk` time steps per program: the grid is (batch, channel blocks, time chunks), so a sequence is
    cut into `T / chunk` chunks that run in parallel and are stitched by a tiny combine pass.
  * `fwd_unroll` steps are unrolled per loop iteration in the forward kernels: their rows are loaded
    together, so the loads of several steps are in flight at once.
  * `bwd_sub_chunk` steps are unrolled per loop iteration in the backward kernels; the backward keeps
    that many `[n, block_d]` states in registers, and the local adjoints stored every
    `bwd_sub_chunk × bwd_adjoint_stride` steps are the only extra memory of the backward.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.common.sizes import is_power_of_2, largest_power_of_2_dividing, next_power_of_2, round_up


CHANNEL_SUMS = ("tree", "shuffle")


@dataclasses.dataclass(frozen=True)
class ScanBlockConfig:
    """Static tiling of one selective-scan call.

    Attributes:
      block_d: channels per program (power of two).
      chunk: time steps per program (a multiple of `fwd_unroll` and `bwd_sub_chunk`).
      fwd_unroll: steps unrolled per loop iteration in the forward kernels.
      bwd_sub_chunk: steps unrolled per loop iteration in the backward kernels (states kept in registers).
      num_warps: Triton warps per program (the [n, block_d] tile is spread over them).
      num_stages: Triton software-pipelining depth (the time loops have no dot, so this matters little).
      bwd_block_d, bwd_num_warps: the same for the backward kernels (None: as the forward). The chunk
        is shared (the backward restarts from the forward's chunk states), channel blocking is not.
      prefetch_bc: load the B/C rows of an unrolled group up front with the other rows (their loads
        overlap, but every thread holds n values per row and step: registers) or at each step.
      hide_channel_alignment: a register-layout hint (see channels.py): one channel per lane instead of
        4-channel vectors. Same values either way; no speed difference was measurable on the H200
        (within the ~10% run-to-run spread), the default is on because the tables were measured so.
      bwd_reuse_decay: the gradients kernel keeps the decays ā of its forward walk over a sub-chunk
        for the reverse walk (bwd_sub_chunk more [n, block_d] tiles in registers, one exp2 per
        element instead of two). Bit-identical results either way; on since 2026-12-01 (op sweep fwd+bwd
        2.88 vs 3.15 ms at B=8 T=2048, within the ~10% spread; no measurable change in the train step).
      bwd_prefetch_rows: both backward kernels load the next sub-chunk's per-channel rows (delta,
        d_out, z and, in the gradients kernel, u; in the input dtype) before computing the current one,
        carried through the time loop, so their global-memory latency overlaps a sub-chunk of work
        (Nsight Compute put 58% of the adjoint summaries kernel's stalls on these loads; the Mamba-3
        walking state passes reached their byte floor this way). Bit-identical results either way;
        on since 2026-12-04 (H200, B=8 T=2048: gradients kernel 1333 -> 1271 us, train step 94.6 -> 92.2 ms).
      bwd_hide_channel_alignment: the layout hint for the backward's adjoint-summaries and gradients
        kernels (None: as the forward; the chunk combines keep the forward's). Without it, the
        gradients kernel's [n, block_d] tiles are laid out 4 states × 4 channels per lane, and its
        per-step sums over the channels (dB, dC) and over the states cross 2–3 lanes instead of 5:
        1382 instead of 1818 SASS instructions per loop iteration (96 instead of 320 shuffles) for
        Triton 3.6 on sm_90 (benchmarks/triton_inspect.py). Off (False) by default since 2026-12-04.
      fast_math: softplus and the sigmoids from the hardware ex2 / rcp and a six-term series instead
        of libdevice (kernel_math.KernelMath): ~1e-6 relative instead of ~2.5e-7 on δ, a quarter of
        a forward step's instructions fewer. On by default (2026-12-04). The prototypes behind
        fwd_parallel / fwd_mosaic / bwd_mosaic keep the exact forms (a ~1e-6 difference in δ between
        their passes and the Triton ones when mixed).
      fused_multiply_add: the kernels' a·b + c updates (state, adjoint, dA, the series) as one fma
        instruction on the GPU (XLA does not let the compiler contract them itself). On by default.
        With fast_math, the hint change and the prefetch (H200, B=8 T=2048, fwd+bwd kernel sum):
        2290 -> 1925 us; the chunk outputs 332 -> 241, the gradients 1329 -> 1054.
      bwd_adjoint_stride: the adjoint summaries store the local adjoint every `bwd_adjoint_stride`
        sub-chunks instead of every sub-chunk (a scratch of [Bt, T / (bwd_sub_chunk·stride), n, d]
        float32 instead of [Bt, T / bwd_sub_chunk, n, d]: 805 MB → 402 MB per layer at B=8 T=2048
        with stride 2). The gradients kernel then walks a block of `stride` sub-chunks right to left:
        one forward pass to find each sub-chunk's start state, then per sub-chunk (last first) the
        usual forward keeping its states and the reverse walk, whose adjoint enters the next one to
        the left. Costs (stride − 1) / stride more forward recomputation. Power of two; 2 by default
        (since 2026-12-06). Stride 2 on an H100 at B=8 T=2048: adjoint summaries 425 → 267 µs,
        gradients 1080 → 1205 µs (kernel sum −31 µs), train step −2.0 ms in three A/B pairs over two
        sessions (88.8 → 86.8 ms this session); GPU-tested. Not yet timed on an H200, whose faster
        HBM shrinks the first gain (benchmarks/notes_selective_scan.md). Stride 4 spills 672 B
        (triton_inspect.py). Set 1 for the previous behaviour (chunks need only be multiples of
        bwd_sub_chunk then).
      f32_state_rows: the kernels read B and C converted to float32 instead of unpacking bf16 / f16
        B and C rows in every step of every kernel. Bit-identical. Off: fewer instructions, but the
        chunk-outputs kernel ran slower with it on the H200 (241 -> 297 us; gradients 1054 -> 1037).
      bwd_channel_sums: how the gradients kernel sums dB_t and dC_t over its channels at every step.
        "tree": `jnp.sum` over the channel axis (Triton's butterfly per value: with the layout hint,
        5 shuffles and 5 adds for each of the 2·n values; without it, fewer shuffles but the results
        and the per-channel rows cross layouts through shared memory, ~33 barriers per 4 steps).
        "shuffle": one reduce-scatter over the warp's 32 lanes for both sums together
        (channel_sums.py: 31 shuffles, 31 adds and 62 selects per step for n = 16 instead of 160 each;
        no shared memory), stored as one [.., 2n] partial. It relies on the layout the hint gives the
        gradients kernel (lane = channel, all n states in the lane's registers), so it needs the
        backward hint on, a backward block of 32 channels on one warp, and n = 16; ValueError
        otherwise. Same sums in another float32 order. "tree" by default: not yet timed on a GPU.
      fwd_parallel: the forward's chunk-outputs pass as a parallel prefix over time
        (forward_parallel.py) instead of a serial walk per lane; off until timed on the GPU.
      parallel_num_warps: Triton warps of that kernel (its [chunk, block_d] tiles are spread over them).
      fwd_mosaic: the forward as the Mosaic GPU prototype (mosaic_forward.py: one warpgroup per 128
        channels, the whole sequence per program) where it applies — no reset mask, one B/C group, d a
        multiple of 128, T a multiple of `chunk`, a CUDA GPU or the interpreter — and the three Triton
        forward launches elsewhere; the same values up to rounding, the backward unchanged. Off: not
        yet compiled or timed on the H200.
      bwd_mosaic: the backward as the Mosaic GPU prototype (mosaic_backward.py: the forward again in
        8-step chunks, then one reverse kernel, thread per channel) where it applies (fwd_mosaic's
        conditions, T a multiple of 8, 8·n <= 256), the three Triton backward launches elsewhere; the
        same values up to rounding. Off: not yet compiled or timed on the H200.
    """

    # Defaults: the best fwd+bwd of the 2026-11-30 H200 sweeps, bwd_sub_chunk from the 2026-12-01
    # backward sweep (2 states in registers: fwd+bwd 2.64 vs 3.18 ms with 4; benchmarks/notes_selective_scan.md).
    block_d: int = 32
    chunk: int = 64
    fwd_unroll: int = 8
    bwd_sub_chunk: int = 2
    num_warps: int = 1
    num_stages: int = 1
    bwd_block_d: int | None = None
    bwd_num_warps: int | None = None
    prefetch_bc: bool = False
    hide_channel_alignment: bool = True
    bwd_reuse_decay: bool = True
    bwd_prefetch_rows: bool = True
    bwd_hide_channel_alignment: bool | None = False
    fast_math: bool = True
    fused_multiply_add: bool = True
    f32_state_rows: bool = False
    bwd_adjoint_stride: int = 2
    bwd_channel_sums: str = "tree"
    fwd_parallel: bool = False
    parallel_num_warps: int = 4
    fwd_mosaic: bool = False
    bwd_mosaic: bool = False

    def validate(self) -> "ScanBlockConfig":
        for name in ("block_d", "fwd_unroll", "bwd_sub_chunk", "num_warps", "bwd_block_d", "bwd_num_warps",
                     "parallel_num_warps", "bwd_adjoint_stride"):
            v = getattr(self, name)
            if v is None and name.startswith("bwd_") and name != "bwd_sub_chunk":
                continue
            if not is_power_of_2(v):
                raise ValueError(f"ScanBlockConfig.{name} must be a positive power of two, got {v!r}")
        if self.bwd_adjoint_stride is None:
            raise ValueError("ScanBlockConfig.bwd_adjoint_stride must be a positive power of two, got None")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"ScanBlockConfig.chunk must be a positive int, got {self.chunk!r}")
        for name in ("fwd_unroll", "bwd_sub_chunk"):
            if self.chunk % getattr(self, name):
                raise ValueError(f"ScanBlockConfig.chunk ({self.chunk}) must be a multiple of {name} "
                                 f"({getattr(self, name)})")
        if self.chunk % (self.bwd_sub_chunk * self.bwd_adjoint_stride):
            raise ValueError(f"ScanBlockConfig.chunk ({self.chunk}) must be a multiple of bwd_sub_chunk × "
                             f"bwd_adjoint_stride ({self.bwd_sub_chunk} × {self.bwd_adjoint_stride})")
        for name in ("prefetch_bc", "hide_channel_alignment", "bwd_reuse_decay", "bwd_prefetch_rows", "fwd_parallel",
                     "fwd_mosaic", "bwd_mosaic", "fast_math", "fused_multiply_add", "f32_state_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ScanBlockConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.bwd_hide_channel_alignment is not None and not isinstance(self.bwd_hide_channel_alignment, bool):
            raise ValueError("ScanBlockConfig.bwd_hide_channel_alignment must be a bool or None, got "
                             f"{self.bwd_hide_channel_alignment!r}")
        if self.bwd_channel_sums not in CHANNEL_SUMS:
            raise ValueError(f"ScanBlockConfig.bwd_channel_sums must be one of {CHANNEL_SUMS}, got "
                             f"{self.bwd_channel_sums!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"ScanBlockConfig.num_stages must be a positive int, got {self.num_stages!r}")
        return self

    def fitted(self, seqlen: int, d: int, group_size: int) -> "ScanBlockConfig":
        """This config shrunk to a call: no chunk longer than the (padded) sequence, and channel blocks
        that never straddle two groups of B/C (block_d must divide d / groups)."""
        def fit(block_d):
            return min(block_d, largest_power_of_2_dividing(group_size), next_power_of_2(d))

        step = max(self.fwd_unroll, self.bwd_sub_chunk * self.bwd_adjoint_stride)
        chunk = self.chunk
        if seqlen < chunk:  # one chunk covers the sequence: round it up to whole unrolled steps
            chunk = round_up(seqlen, step)
        hint = self.hide_channel_alignment if self.bwd_hide_channel_alignment is None else self.bwd_hide_channel_alignment
        return dataclasses.replace(
            self, block_d=fit(self.block_d), chunk=chunk, bwd_block_d=fit(self.bwd_block_d or self.block_d),
            bwd_num_warps=self.bwd_num_warps or self.num_warps, bwd_hide_channel_alignment=hint).validate()

    def for_backward(self) -> "ScanBlockConfig":
        """The config the backward kernels run with (their channel block and warps)."""
        hint = self.hide_channel_alignment if self.bwd_hide_channel_alignment is None else self.bwd_hide_channel_alignment
        return dataclasses.replace(self, block_d=self.bwd_block_d or self.block_d,
                                   num_warps=self.bwd_num_warps or self.num_warps, hide_channel_alignment=hint)


DEFAULT_CONFIG = ScanBlockConfig()


@dataclasses.dataclass(frozen=True)
class ScanProblem:
    """Static description of one (padded) call, shared by the kernels of its forward and backward.

    Attributes:
      seqlen: the true T; steps at or past it are padding (δ forced to 0, so they are the identity).
      padded_seqlen: T rounded up to a multiple of `config.chunk`.
      d: channels; n: d_state padded to a power of two; group_size: d / groups.
      has_z, has_D, has_bias, has_reset: which optional inputs are present.
      softplus: apply the thresholded softplus to delta + delta_bias.
      config: the (fitted) block configuration.
      interpret: run the kernels with the Pallas interpreter (CPU tests).
      z_offset: the gate's first channel in the z array (0: z is [Bt, T, d]; > 0: z is a wider array,
        e.g. in_proj's packed x | z output read in place; a multiple of both channel blocks).
    """

    seqlen: int
    padded_seqlen: int
    d: int
    n: int
    group_size: int
    has_z: bool
    has_D: bool
    has_bias: bool
    has_reset: bool
    softplus: bool
    config: ScanBlockConfig
    interpret: bool = False
    z_offset: int = 0

    @property
    def n_chunks(self) -> int:
        return self.padded_seqlen // self.config.chunk

    @property
    def n_channel_blocks(self) -> int:
        return self.d // self.config.block_d

    @property
    def n_sub_chunks(self) -> int:
        return self.config.chunk // self.config.bwd_sub_chunk

    @property
    def adjoint_steps(self) -> int:
        """Steps between two stored sub-chunk adjoints (bwd_sub_chunk × bwd_adjoint_stride)."""
        return self.config.bwd_sub_chunk * self.config.bwd_adjoint_stride

    @property
    def n_stored_adjoints(self) -> int:
        """Stored sub-chunk adjoints per chunk."""
        return self.config.chunk // self.adjoint_steps

    @property
    def has_time_padding(self) -> bool:
        return self.padded_seqlen != self.seqlen

    def for_backward(self) -> "ScanProblem":
        return dataclasses.replace(self, config=self.config.for_backward())

    def grid(self, batch: int, per_chunk: bool = True):
        """The flattened program grid: (batch, channel block, chunk), or (batch, channel block)."""
        from pallas_kernels.selective_scan.layout import ProgramGrid
        return ProgramGrid(batch, self.n_channel_blocks, self.n_chunks if per_chunk else 1)
