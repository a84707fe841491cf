"""What a training stack does, torch-free: the software half of a plan's cost.

A *stack* is one training software's behaviour (kernels, what each recompute policy saves, when
parameters are gathered and gradients reduced, which traffic overlaps compute, its fixed costs
per step and per micro-batch and its optimizer's efficiency), kept apart from the model (shape),
the system (GPUs and links, rates measured on bare hardware) and the layout (tp, pp, dp,
micro-batch, schedule). The planner's memory and time models both read one `Stack`; the llmscale
runtime is one stack among them (`LLMSCALE`), and its predicted = measured tests are that
stack's conformance tests. Its costs on a device measured with it (this machine's CPU:
train/calibration.py) are the stack's too (`DeviceCosts`, `Stack.on_device`), not the device's.

Each rule on which stacks differ is a small function here (`param_residency`, `recompute_problem`,
`tied_pipeline_problem`), called by the memory and the time model alike, so the two cannot
disagree about it. The records themselves are data: `llmscale plan --stack NAME` picks one, and
`STACKS` generates that flag's help.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from llmscale.config import OFFLOAD_MODES, RUNTIME_FLOAT8_RECIPES, RUNTIME_PRECISIONS, Offload
from llmscale.errors import ConfigError
from llmscale.hardware.spec import Sourced
from llmscale.stack.kernels import MEGATRON_2021 as MEGATRON_2021_KERNELS
from llmscale.stack.kernels import RUNTIME, Kernels

__all__ = [
    "LLMSCALE",
    "MEGATRON_2021",
    "MEGATRON_CORE",
    "STACKS",
    "STACK_NAMES",
    "TORCHTITAN",
    "DeviceCosts",
    "Fit",
    "Kernels",
    "Residency",
    "Stack",
    "get_stack",
    "layout_problem",
    "recompute_problem",
    "schedule_problem",
    "param_residency",
    "fitted_note",
    "fitted_values",
    "float8_recipe_help",
    "float8_recipe_problem",
    "precision_problem",
    "stacks_help",
    "tied_pipeline_problem",
]

# When a data-parallel-sharded stage's parameters are gathered and its gradients reduced; each
# policy is one branch of `param_residency`.
Sharding = Literal["llmscale", "fsdp2_default", "megatron"]
Elementwise = Literal["llmscale", "torchtitan", "saved"]
PipelineOutputsKept = Literal["none", "last", "all"]


# The fixed cost of an optimizer step on a GPU, whatever the stack (no published figure).
STEP_OVERHEAD = Sourced(
    10.0,
    "assumption: ~10 ms per optimizer step of launches, gradient-norm and loss-scale syncs, "
    "zeroing and logging",
)


# The fixed cost of a micro-batch on a GPU, whatever the stack.
ASYNC_DISPATCH = Sourced(
    0.0,
    "assumption: a GPU's kernel launches are asynchronous, issued ahead of the kernels of a "
    "training-sized micro-batch, so the host's per-op dispatch is hidden",
)


# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the allocator maps pages into one segment
# per stream that grows and shrinks, so blocks of different sizes no longer strand the rest of
# fixed-size segments (PyTorch "CUDA semantics", optimizing memory usage); what it reserves
# beyond what is allocated is page rounding (2 MiB pages), taken as none.
EXPANDABLE_SEGMENTS_OVERHEAD = Sourced(
    0.0,
    "PyTorch 'CUDA semantics', optimizing memory usage: with expandable segments the caching "
    "allocator maps pages into one growing segment per stream; page rounding (2 MiB) taken as "
    "none",
)

# What a caching allocator without expandable segments holds beyond what is allocated.
ALLOCATOR_OVERHEAD = Sourced(
    0.05,
    "assumption: the caching allocator's fixed-size segments strand part of what they reserve "
    "when blocks of different sizes come and go (no published Megatron-Core run gives its "
    "reserved memory)",
)


# The calibration rates of every kernel on a part's SMs (its GEMMs, FP8 and FP4 GEMMs and flash
# attention), which its clocks, set by its power limit, scale alike; its HBM bandwidth is not
# among them. What a fit on a part's clocks scales (`Fit.fields`).
SM_RATES = (
    "gemm_efficiency",
    "fp8_gemm_efficiency",
    "fp4_gemm_efficiency",
    "attention_efficiency",
)

# A Hopper part's (no FP4 tensor cores).
HOPPER_SM_RATES = tuple(r for r in SM_RATES if r != "fp4_gemm_efficiency")


@dataclass(frozen=True)
class Fit:
    """A factor fitted on a published run of a stack: it scales `fields` of GPU `gpu`'s
    calibration (hardware/catalog.py `Calibration`: the bare GPU's rates) when that stack runs
    on it. Its source names the row it was fitted on (validation/data/runs.toml or
    published.toml), which is therefore a `calibration` row, never a validation one."""

    gpu: str
    fields: tuple[str, ...]
    scale: Sourced


@dataclass(frozen=True, kw_only=True)
class DeviceCosts:
    """A stack's own costs measured on one device (train/calibration.py: the llmscale runtime
    micro-benchmarked on this machine), as opposed to the device's rates (hardware/catalog.py
    `Calibration`: its GEMM, attention and element-wise bandwidth, which the same calibration
    measures). `Stack.on_device` prices the stack with them; each is `Sourced` to the
    calibration that measured it.

    - step_overhead_ms: fixed cost per optimizer step beyond the micro-batches' and the
      optimizer's own (the calibration does not measure one: none);
    - microbatch_overhead_ms: fixed cost of one micro-batch's forward and backward on one
      pipeline rank, whatever its size (per-op dispatch and autograd bookkeeping where the host
      waits for each op, as on a CPU): the model's forward and backward on one token;
    - optimizer_efficiency: achieved / the device's bandwidth of the stack's optimizer step (a
      CPU's per-tensor foreach fallback gets much less than its element-wise ops);
    - comm_overlap: how much of the communication run beside compute the device hides (the
      stack's `dp_overlap`); None keeps the stack's (a GPU's collectives run on their own
      SMs), 0 on a CPU, whose ranks copy their gloo sends and receives on their compute core.
    """

    device: str  # the measured device's display name
    step_overhead_ms: Sourced
    microbatch_overhead_ms: Sourced
    optimizer_efficiency: Sourced
    comm_overlap: Sourced | None = None


@dataclass(frozen=True, kw_only=True)
class Stack:
    """One training stack's facts, each stated once (see the module docstring)."""

    name: str
    summary: str  # one line: `--stack` help
    source: str  # where the facts come from (repository at a commit, paper)
    kernels: Kernels
    # Recompute policies it can run, in the runtime's names (config.Recompute): "selective" is
    # always the attention core; a policy it lacks is refused with `refusals`' line.
    recompute: tuple[str, ...]
    refusals: tuple[tuple[str, str], ...] = ()  # (policy, what to use instead)
    # Pipeline schedules it can run, in the runtime's names (config.PPSchedule).
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv",
                                  "dualpipev")  # fmt: skip
    sharding: Sharding
    # How element-wise HBM traffic is counted (plan/time.py): this runtime's eager ops,
    # torchtitan's eager Llama, or fused kernels ("saved": passes over the saved bytes).
    elementwise: Elementwise
    # Data-parallel gradients of replicas reduced once per step (no_sync on all but the last
    # micro-batch) rather than after every micro-batch.
    grad_sync_once: bool
    # Share of a data-parallel collective's time hidden when it runs beside compute (0: the
    # stack does not overlap it: Megatron 2021 all-reduces after the pipeline flush).
    dp_overlap: float = 0.85
    # Tensor-parallel collectives run beside the GEMMs they feed (Megatron-Core's TP
    # communication overlap, TransformerEngine userbuffers): exposed only past the GEMMs.
    tp_overlap_gemm: bool = False
    # The overlapped GEMMs run as tp row chunks, one per peer's shard of the tokens, so that
    # each chunk's GEMM runs while the next shard arrives or the previous one is sent: torch's
    # micro-pipelined ("async") TP, whose inductor pass (torch/_inductor/fx_passes/
    # micro_pipeline_tp.py) rewrites all-gather -> matmul into `fused_all_gather_matmul` and
    # matmul -> reduce-scatter into `fused_matmul_reduce_scatter`
    # (torch/distributed/_symmetric_memory/__init__.py: `_pipelined_all_gather_and_consume`
    # hands each of the group's shards to the matmul, `_fused_matmul_reduce_scatter_impl`
    # multiplies `A.chunk(group.size())`). Only under sequence parallelism (the pass fuses
    # all-gathers and reduce-scatters, not all-reduces); the weight gradients, which contract
    # over the gathered tokens, stay whole. A fused reduce-scatter ends with a reduction kernel
    # over the partial shards, and a reduce-scatter whose input is not one matmul's output (the
    # backward's sum of several linears' input gradients) stays unfused (plan/time.py
    # `_tp_block_seconds`).
    tp_overlap_chunks: bool = False
    # Precisions in which it runs the TP collectives without that overlap.
    tp_overlap_off_under: tuple[str, ...] = ()
    p2p_scatter_gather: bool = False  # pipeline sends split over the TP ranks (Megatron 2021)
    optimizer_bytes_per_param: float = 28.0  # AdamW foreach, fp32: read p g m v, write p m v
    # torch.distributed.pipelining keeps a receive buffer pair per micro-batch and 1F1B holds
    # one micro-batch more ("torch"); Megatron frees each output once sent ("freed").
    pipeline: Literal["torch", "freed"] = "torch"
    # Which pipeline stages keep every micro-batch's output until the step ends (torch's
    # `PipelineStage.output_chunks`, merged for the caller of `schedule.step`): none (step with
    # return_outputs=False: the llmscale runtime, torchtitan since its #1922, 2025-10), the
    # last stage's (its logits; torch's default return_outputs), or every stage's (torch
    # before pytorch#153383, 2025-05, appended each stage's output whatever its place).
    pipeline_outputs_kept: PipelineOutputsKept = "none"
    # Tied embedding and output projection under pipeline parallelism: refused, or a copy of
    # the embedding on the last stage whose gradient is all-reduced with the first's once per
    # step (Megatron's embedding group; DeepSpeed's TiedLayerSpec).
    tied_under_pp: Literal["refuse", "copy_on_last_stage"] = "refuse"
    # Bytes per parameter of the gradients accumulated unsharded until the step's reduce (fp32
    # main gradients; 2 where a stack reduces in bf16: Megatron's grad_reduce_in_fp32 = False).
    main_grad_bytes: int = 4
    # Under fp8, the block linears' weights kept in FP8 (1 B) between steps: Megatron's
    # --fp8-param-gather (TransformerEngine's fp8_model_init), which Megatron-Bridge's FP8
    # recipes set (src/megatron/bridge/training/mixed_precision.py: delayed, current-scaling and
    # MXFP8; not NVFP4). Gathered in FP8 and quantised once per step from the fp32 main
    # weights: no weight cast per micro-batch, a transpose of the FP8 weight for backward.
    fp8_params: bool = False
    # The caching allocator's share over what is allocated (fragmentation of its fixed-size
    # segments; a run with expandable segments: `EXPANDABLE_SEGMENTS_OVERHEAD`).
    allocator_overhead: Sourced = ALLOCATOR_OVERHEAD
    device_reserve_GiB: float = 1.5  # CUDA context, cuBLAS workspace, NCCL buffers
    prefetch_blocks: int = 2  # FSDP units unsharded at once under reshard-after-forward
    # FSDP2 wraps the model whenever dp_shard x cp > 1, sharding over the flattened dp_shard_cp
    # mesh even with dp_shard 1 (torchtitan's ParallelDims.fsdp_enabled); else only with
    # dp_shard > 1, the cp ranks all-reducing a replica (the llmscale runtime).
    fsdp_over_cp: bool = False
    # Its software's fixed costs on the device it is priced on: by default a catalog GPU's (an
    # assumed cost per optimizer step; no per-micro-batch cost, launches being asynchronous;
    # the optimizer at the GPU's streaming `hbm_efficiency`, None); on a device measured with
    # the runtime, the costs measured there (`on_device`).
    step_overhead_ms: Sourced = STEP_OVERHEAD
    microbatch_overhead_ms: Sourced = ASYNC_DISPATCH
    optimizer_efficiency: Sourced | None = None
    # Values fitted on this stack's published runs, per GPU (`Fit`).
    fitted: tuple[Fit, ...] = ()
    # How context parallelism moves K and V: a p2p ring step by step (TransformerEngine), or
    # torch's `context_parallel` with its default rotation, one all-gather per attention call
    # (torch.distributed.tensor.experimental._context_parallel, `_cp_options.rotate_method`).
    cp_rotate: Literal["ring", "allgather"] = "ring"
    # Whether it splits a sequence over context-parallel ranks at all (the search tries cp > 1
    # only where it does; `--cp` > 1 is refused where it does not).
    context_parallel: bool = True
    # With torch.compile on, the loss is compiled too (`Kernels.compiled_loss`); the llmscale
    # runtime compiles its blocks only (parallel/compile.py).
    compiles_loss: bool = False
    # How the first blocks' saved activations go to host memory and back
    # (train.offload_activations): not at all ("refuse"); each tensor copied as it is saved and
    # as backward needs it, on the compute stream ("blocking": torch.autograd.graph.save_on_cpu,
    # the llmscale runtime); or on a side stream behind the compute ("async": TransformerEngine's
    # CPU offload context, Megatron-Core's --cpu-offloading-num-layers N: block i's offload is
    # due by the forward of block n_layers - N + i and its reload starts N blocks ahead in
    # backward, transformer_engine/pytorch/cpu_offload.py `_default_offload_sync_init`).
    activation_offload: Literal["refuse", "blocking", "async"] = "refuse"
    # The optimizer offload modes (optimizer.offload: config.Offload) it runs, and what a user
    # of the stack sets for them; others are refused (`offload_problem`).
    offloads: tuple[Offload, ...] = ("none",)
    offload_flags: str = ""
    # Precisions it trains in (config.Precision): nvfp4 is TransformerEngine's NVFP4 recipe,
    # which only Megatron-Core runs among these.
    precisions: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")
    # Float8 recipes it runs under fp8 (config.Float8Recipe): torchao's three where it trains
    # with torchao's float8 linears; TransformerEngine's current scaling ("tensorwise") and MXFP8
    # block scaling ("mxfp8") where TransformerEngine's are its fp8 (its 128 x 128 blocks are
    # not modelled).
    float8_recipes: tuple[str, ...] = RUNTIME_FLOAT8_RECIPES
    # The share of the per-tensor-scaled FP8 GEMM's rate (the GPU's `fp8_gemm_efficiency`) that
    # its GEMMs of a block-scaled float8 recipe reach, by recipe (plan/time.py
    # `block_gemm_seconds`): fitted on its published runs; a recipe not named runs at the FP8
    # GEMM's rate (torchao's rowwise GEMM has its own, measured share: `ROWWISE_GEMM_SHARE`).
    float8_gemm_shares: tuple[tuple[str, Sourced], ...] = ()

    def float8_gemm_share(self, recipe: str) -> float:
        """The share of the FP8 GEMM's rate this stack's GEMMs of float8 `recipe` reach."""
        return next((share.value for r, share in self.float8_gemm_shares if r == recipe), 1.0)

    def kernels_for(self, compiled: bool) -> Kernels:
        """The kernels this stack runs with torch.compile on (`compiled`) or off."""
        if compiled and self.compiles_loss:
            return replace(self.kernels, compiled_loss=True)
        return self.kernels

    def on(self, **changes: object) -> Stack:
        """This stack with some facts replaced (a measured device's kernels, say)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def on_device(self, costs: DeviceCosts) -> Stack:
        """This stack priced on a device measured with it: its fixed costs are `costs`."""
        overlap = self.dp_overlap if costs.comm_overlap is None else costs.comm_overlap.value
        return replace(
            self,
            step_overhead_ms=costs.step_overhead_ms,
            microbatch_overhead_ms=costs.microbatch_overhead_ms,
            optimizer_efficiency=costs.optimizer_efficiency,
            dp_overlap=overlap,
        )

    def sharded_dp_name(self, zero_stage: int) -> str:
        """What this stack calls sharded data parallelism at `zero_stage`: Megatron's
        distributed optimizer at 1 ("distopt"), else FSDP."""
        return "distopt" if self.sharding == "megatron" and zero_stage == 1 else "fsdp"

    def optimizer_share(self, hbm_efficiency: Sourced) -> float:
        """Achieved / datasheet bandwidth of the optimizer step on a device whose streaming
        kernels reach `hbm_efficiency` (`optimizer_efficiency` when measured)."""
        return (self.optimizer_efficiency or hbm_efficiency).value


@dataclass(frozen=True)
class Residency:
    """When a stage's parameters are gathered and its gradients reduced (data-parallel
    sharding: FSDP2, ZeRO, Megatron's distributed optimizer), the one rule memory and time read.

    gathers_per_microbatch: 0 = once per optimizer step (kept unsharded across micro-batches),
    1 = in each micro-batch's forward, 2 = in its forward and again in its backward.
    grads_per_step: gradients reduced (reduce-scattered) once per step, else per micro-batch.
    stage_unsharded: every block of the stage is unsharded from its forward to its backward
    (else a prefetch window of blocks). grads_unsharded: unsharded fp32 gradients are held
    until the step's reduce (else sharded accumulators).
    """

    gathers_per_microbatch: int
    grads_per_step: bool
    stage_unsharded: bool
    grads_unsharded: bool


def param_residency(stack: Stack, *, zero_stage: int, pp: int, n_microbatches: int) -> Residency:
    """The stack's gather and reduce rule for a sharded data-parallel layout."""
    match stack.sharding:
        case "llmscale":
            if pp > 1:
                # torch.distributed.pipelining: PipelineStage turns off gradient sync and
                # resharding after backward for every micro-batch and reduces once at the step's
                # end; under zero 3 each F reshards its stage and the next B gathers it again,
                # kept until the next F: m + 1 gathers per step, about one per micro-batch
                # (measured; stack/residency.pipeline_gathers has the exact counts).
                return Residency(1 if zero_stage == 3 else 0, True, True, True)
            if zero_stage == 3:
                return Residency(2, False, False, False)
            if zero_stage == 2:  # DeepSpeed ZeRO-2: sharded accumulators
                return Residency(0, False, True, False)
            # ZeRO-1 (Megatron's distributed optimizer): accumulated unsharded, one reduce.
            return Residency(0, True, True, n_microbatches > 1)
        case "fsdp2_default":
            # torchtitan's fsdp_reshard_after_forward "default": reshard after forward unless
            # pipelined ("to avoid per-microbatch all-gathers"); under PP, PipelineStage's
            # no-sync backward as above. zero 1/2 read as its "never".
            if pp > 1:
                return Residency(0, True, True, True)
            if zero_stage == 3:
                return Residency(2, False, False, False)
            return Residency(1, False, True, False)
        case "megatron":
            if zero_stage == 1:
                # The distributed optimizer: parameters all-gathered once per step (overlapped
                # with the first forward), fp32 main gradients accumulated in an unsharded buffer
                # and reduce-scattered once (overlapped with the last backward).
                return Residency(0, True, True, True)
            if zero_stage == 2:  # Megatron FSDP "optim_grads"
                return Residency(0, False, True, False)
            return Residency(2, False, False, False)  # Megatron FSDP "optim_grads_params"
    raise ConfigError("stack.sharding", stack.sharding, "llmscale | fsdp2_default | megatron")


def recompute_problem(stack: Stack, recompute: str) -> str | None:
    """Why `stack` cannot run recompute policy `recompute` (None when it can)."""
    if recompute in stack.recompute:
        return None
    instead = dict(stack.refusals).get(recompute)
    allowed = " | ".join(stack.recompute)
    return f"{allowed} under --stack {stack.name}" + (f" ({instead})" if instead else "")


def schedule_problem(stack: Stack, schedule: str) -> str | None:
    """Why `stack` cannot run pipeline schedule `schedule` (None when it can)."""
    if schedule in stack.schedules:
        return None
    return f"{' | '.join(stack.schedules)} under --stack {stack.name}"


def activation_offload_problem(stack: Stack, offload_activations: int) -> str | None:
    """Why `stack` cannot offload `offload_activations` blocks' activations (None when it can)."""
    if offload_activations and stack.activation_offload == "refuse":
        return f"0 under --stack {stack.name} (it has no activation offload; recompute instead)"
    return None


def offload_problem(stack: Stack, offload: str) -> str | None:
    """Why `stack` cannot run optimizer offload mode `offload` (None when it can)."""
    if offload in stack.offloads:
        return None
    how = f" ({stack.offload_flags})" if stack.offload_flags else ""
    return f"{' | '.join(stack.offloads)} under --stack {stack.name}{how}"


def precision_problem(stack: Stack, precision: str) -> str | None:
    """Why `stack` cannot train in `precision` (None when it can)."""
    if precision in stack.precisions:
        return None
    runs = [s.name for s in STACKS.values() if precision in s.precisions]
    where = f" ({precision}: --stack {' | '.join(runs)})" if runs else ""
    return f"{' | '.join(stack.precisions)} under --stack {stack.name}{where}"


def float8_recipe_problem(stack: Stack, recipe: str) -> str | None:
    """Why `stack` cannot run float8 `recipe` (None when it can)."""
    if recipe in stack.float8_recipes:
        return None
    runs = [s.name for s in STACKS.values() if recipe in s.float8_recipes]
    where = f" ({recipe}: --stack {' | '.join(runs)})" if runs else ""
    return f"{' | '.join(stack.float8_recipes)} under --stack {stack.name}{where}"


def layout_problem(
    stack: Stack,
    *,
    recompute: str | None,
    schedule: str | None,
    pp: int,
    tied: bool,
    offload_activations: int = 0,
    precision: str | None = None,
    float8_recipe: str | None = None,
    offload: str | None = None,
    cp: int = 1,
) -> tuple[str, object, str] | None:
    """The first of `stack`'s refusals a layout meets, as (config key, value, what is allowed
    instead), None when it runs: the one check `plan --stack` (a recompute policy or schedule
    fixed by a flag; None: searched) and `train --dry-run --stack` apply."""
    checks: tuple[tuple[str, object, str | None], ...] = (
        ("precision.mode", precision, precision and precision_problem(stack, precision)),
        (
            "precision.float8_recipe",
            float8_recipe,
            float8_recipe and float8_recipe_problem(stack, float8_recipe),
        ),
        ("train.recompute", recompute, recompute and recompute_problem(stack, recompute)),
        ("parallel.pp", pp, tied_pipeline_problem(stack, tied, pp)),
        ("parallel.cp", cp, context_parallel_problem(stack, cp)),
        ("parallel.pp_schedule", schedule, schedule and schedule_problem(stack, schedule)),
        (
            "train.offload_activations",
            offload_activations,
            activation_offload_problem(stack, offload_activations),
        ),
        ("optimizer.offload", offload, offload and offload_problem(stack, offload)),
    )
    for key, value, problem in checks:
        if problem:
            return key, value, problem
    return None


def context_parallel_problem(stack: Stack, cp: int) -> str | None:
    """Why `stack` cannot split sequences over `cp` ranks (None when it can)."""
    if cp > 1 and not stack.context_parallel:
        runs = " | ".join(s.name for s in STACKS.values() if s.context_parallel)
        return f"1 under --stack {stack.name} (no context parallelism; cp > 1: --stack {runs})"
    return None


def tied_pipeline_problem(stack: Stack, tied: bool, pp: int) -> str | None:
    """Why `stack` cannot pipeline a model with tied embeddings (None when it can)."""
    if tied and pp > 1 and stack.tied_under_pp == "refuse":
        return f"pp 1 with tied embeddings under --stack {stack.name}"
    return None


LLMSCALE = Stack(
    name="llmscale",
    summary="this project's runtime, described by the facts it calls itself (the default)",
    source="src/llmscale (model/config.py's TP and recompute tables, config.py's schedules)",
    kernels=RUNTIME,
    recompute=("none", "selective", "selective_op", "full", "every_k"),
    sharding="llmscale",
    elementwise="llmscale",
    grad_sync_once=True,
    tied_under_pp="copy_on_last_stage",  # parallel/tied_embeddings.py
    activation_offload="blocking",  # parallel/activation_offload.py
    offloads=OFFLOAD_MODES,  # offload/ (docs/offload.md)
    precisions=RUNTIME_PRECISIONS,  # parallel/parallelize.py refuses the others
)

MEGATRON_2021 = Stack(
    name="megatron-2021",
    summary="Megatron-LM as Narayanan et al. 2021 and Korthikanti et al. 2022 ran it: fp16, "
    "dropout, a materialised s x s softmax, DP all-reduce after the flush",
    source="Narayanan et al. 2021 (arXiv:2104.04473); Korthikanti et al. 2022 (arXiv:2205.05198)",
    kernels=MEGATRON_2021_KERNELS,
    recompute=("none", "selective", "full", "every_k"),
    refusals=(("selective_op", "Megatron's selective recomputation is --recompute selective"),),
    schedules=("1f1b", "interleaved_1f1b"),
    sharding="megatron",
    elementwise="saved",  # fused kernels: bias-GeLU, masked softmax, bias-dropout-add
    grad_sync_once=True,
    dp_overlap=0.0,
    p2p_scatter_gather=True,
    # Megatron's fp16 optimizer per parameter: unscale and inf-check the fp32 main gradient
    # (read 4, write 4), its norm (read 4), Adam (read p g m v, write p m v: 28), copy the fp32
    # master into the fp16 weight (read 4, write 2).
    optimizer_bytes_per_param=46.0,
    pipeline="freed",
    tied_under_pp="copy_on_last_stage",
    # Neither paper splits a sequence over ranks: Korthikanti et al.'s sequence parallelism
    # shares the tensor-parallel group (--sp); context parallelism is later Megatron-Core's.
    context_parallel=False,
    float8_recipes=("tensorwise",),
    fitted=(
        Fit(
            "a100-80g",
            ("gemm_efficiency",),
            Sourced(
                1.03,
                "fitted on Narayanan et al. 2021 Table 1, row 10 (1T, t8 p64 d6, 3,072 A100 80GB, "
                "163 TFLOP/s per GPU): Megatron-LM's fp16 GEMMs against the catalog's assumed "
                "A100 share (validation/data/published.toml narayanan2021, the calibration "
                "row); the other Table 1 rows and Korthikanti et al. 2022 are predictions",
            ),
        ),
    ),
)

# What TransformerEngine's MXFP8 GEMMs (cuBLAS's block-scaled FP8 GEMM, an E8M0 scale per 32
# elements of each operand) reach of its per-tensor-scaled FP8 GEMM's rate under Megatron-Core:
# one share for the Blackwell parts, fitted on the FP8-MX figures that Megatron-Bridge's 25.11
# summary prints beside the FP8-CS ones of the same 8-GPU Llama 3 8B job (its casts are
# priced apart: plan/time.py `MXFP8_CAST_BYTES`).
MEGATRON_CORE_MXFP8 = Sourced(
    0.83,
    "fitted on rows mbridge-2511-gb200-llama3-8b-mxfp8 and mbridge-2511-gb300-llama3-8b-mxfp8 "
    "(Megatron-Bridge performance summary, 25.11, Llama 3 8B on 8 GPUs, FP8-MX 29,789 and 36,108 "
    "tokens/s/GPU beside FP8-CS 31,508 and 37,556; the calibration rows of "
    "validation/data/runs.toml): the share that puts both within 1%; it carries whatever MXFP8 "
    "costs beyond its quantisation passes (the block-scaled GEMM itself, its scales' layout)",
)

MEGATRON_CORE = Stack(
    name="megatron-core",
    summary="Megatron-Core / NeMo 2 as run today: flash attention, no dropout, bf16, "
    "distributed optimizer (--dp-shard N --zero-stage 1) with overlapped grad and param sync, "
    "TP communication overlap",
    source="NVIDIA/Megatron-LM megatron/core (TransformerConfig, DistributedDataParallelConfig: "
    "overlap_grad_reduce, overlap_param_gather, use_distributed_optimizer; tp_comm_overlap); "
    "NeMo 2 Llama pretraining recipes",
    kernels=Kernels(
        attention="flash",  # TransformerEngine fused attention (cuDNN / flash)
        dropout=False,  # Llama-family recipes: attention and hidden dropout 0
        residual_fp32=False,  # fp32_residual_connection off by default
        sp_saves_gathered_input=False,  # SP inputs re-gathered in backward
        vocab_parallel=True,
        loss_parallel=True,  # vocab-parallel cross-entropy
        # TransformerEngine's fused cross-entropy: Megatron-Bridge's GPTModelProvider sets
        # cross_entropy_loss_fusion and its performance scripts cross_entropy_fusion_impl =
        # "te" (scripts/performance/utils/helpers.py at v0.2.0, 2025-11; overrides.py since).
        # Runs of other dates state theirs (validation/runs.py ROW_FACTS, `loss_kernel`).
        loss_kernel="te",
        fused_swiglu=True,  # bias_activation_fusion: BiasSwiGLUFunction keeps its input only
        fp8_saves_casts=True,  # TransformerEngine's fp8 linears save their float8 inputs
    ),
    recompute=("none", "selective", "full", "every_k"),
    refusals=(("selective_op", "Megatron's selective recomputation is --recompute selective"),),
    schedules=("1f1b", "interleaved_1f1b"),  # Megatron-Core's forward_backward functions
    sharding="megatron",
    elementwise="saved",  # TransformerEngine's fused norm-linear, bias-activation, RoPE
    grad_sync_once=True,
    tp_overlap_gemm=True,
    # Megatron-Bridge's performance configurations turn TransformerEngine's TP overlap off
    # under NVFP4, every Llama one (scripts/performance/configs/llama/llama3{,1}_llm_pretrain.py
    # at c0b9a0003: `tp_comm_overlap = False if precision == "nvfp4"`).
    tp_overlap_off_under=("nvfp4",),
    # Megatron-Bridge's FP8 recipes set fp8_param_gather (src/megatron/bridge/training/
    # mixed_precision.py: bf16_with_fp8_current_scaling_mixed, bf16_with_mxfp8_mixed, the
    # delayed-scaling ones), so a plan under fp8 keeps FP8 weights unless told otherwise
    # (`plan --no-fp8-param-gather`, llmscale.stack.options; NeMo 1's runs: fp8_params False).
    fp8_params=True,
    # Gradients accumulated and reduced in bf16, as NVIDIA's published configurations run:
    # Megatron-Bridge's performance scripts (scripts/performance/configs/llama/
    # llama3{,1}_llm_pretrain.py set_llama3{,1}_common_configs: grad_reduce_in_fp32 = False) and
    # NeMo 1's performance launcher scripts (+training.model.optim.grad_sync_dtype=bf16). The
    # library default is fp32 main gradients (Megatron-LM forces them under --bf16 unless
    # --grad-reduce-in-bf16; Megatron-Bridge's recipes, NeMo 1's base configs): `plan
    # --no-grad-reduce-in-bf16` (llmscale.stack.options), a row fact of runs that ran so.
    main_grad_bytes=2,
    # bf16 distributed Adam over the shard: grad norm (read 4), Adam (read p g m v 16, write p
    # m v 12), the bf16 parameter written back (2).
    optimizer_bytes_per_param=34.0,
    pipeline="freed",
    tied_under_pp="copy_on_last_stage",
    activation_offload="async",  # --cpu-offloading-num-layers (TransformerEngine's context)
    # Megatron-Core's hybrid-device optimizer: the distributed optimizer's states and step on the
    # host, gradients down and parameters up each step (megatron/core/optimizer/cpu_offloading/,
    # Megatron-LM 60007c93d3, 2025-02-14): ZeRO-Offload's "optimizer".
    offloads=("none", "optimizer"),
    offload_flags="optimizer: --optimizer-cpu-offload --optimizer-offload-fraction 1.0 "
    "--use-precision-aware-optimizer",
    # --fp4-format e2m1 with fp4_recipe "nvfp4": TransformerEngine's NVFP4BlockScaling
    # (megatron/core/transformer/transformer_config.py `fp4`, `fp4_recipe`).
    precisions=("fp32", "bf16", "fp16", "fp8", "nvfp4"),
    # TransformerEngine's current scaling (fp8_cs) and MXFP8 block scaling (fp8_mx:
    # Megatron-Bridge scripts/performance/utils/precision.py, MXFP8BlockScaling on Blackwell).
    float8_recipes=("tensorwise", "mxfp8"),
    float8_gemm_shares=(("mxfp8", MEGATRON_CORE_MXFP8),),
    # What Megatron-Core's kernels reach on the two NVL72 parts, whose datasheets give the same
    # dense peaks (GB200 and GB300 NVL72 pages: 360 PF BF16 and 720 PF FP8 with sparsity per 72
    # GPUs) while the published 8-GPU Llama 3 8B job, identical on both, runs 1.19x faster on
    # GB300 (1400 W) than on GB200 (1200 W): one factor on the GEMMs, FP8 GEMMs and flash
    # attention of each part (the catalog's Blackwell shares are assumed ones). Fitted on the
    # 8B rows; every other row on these parts is a prediction.
    fitted=(
        Fit(
            "gb200",
            SM_RATES,
            Sourced(
                0.94,
                "fitted on row mbridge-2511-gb200-llama3-8b-fp8 (Megatron-Bridge performance "
                "summary, 25.11, DGX-GB200, Llama 3 8B on 8 GPUs, FP8-CS, 31,508 tokens/s/GPU; "
                "the calibration row of validation/data/runs.toml)",
            ),
        ),
        Fit(
            "gb300",
            SM_RATES,
            Sourced(
                1.17,
                "fitted on row mbridge-2511-gb300-llama3-8b-fp8 (Megatron-Bridge performance "
                "summary, 25.11, DGX-GB300, Llama 3 8B on 8 GPUs, FP8-CS, 37,556 tokens/s/GPU; "
                "the calibration row of validation/data/runs.toml)",
            ),
        ),
    ),
)

TORCHTITAN_HOPPER = Sourced(
    0.74,
    "fitted on row tt2412-8b-8gpu-fsdp (torchtitan docs/performance.md, Dec 2024: Llama 3.1 8B "
    "on 8 x H100 96GB at 500 W, FSDP, 5,762 tokens/s/GPU; the calibration row of "
    "validation/data/runs.toml): the share of the catalog's Hopper rates (the H100 SXM5's, the "
    "same die in the H100 96GB and the H200) that torchtitan's kernels reach; every other "
    "Hopper row is a prediction",
)

# What a torchtitan run's caching allocator reserves beyond the allocated peak the planner
# predicts: the memory torchtitan logs and its benchmarks publish is
# torch.cuda.max_memory_reserved (components/metrics.py max_reserved_gib), under the
# expandable segments its launcher sets (run_train.sh: PYTORCH_CUDA_ALLOC_CONF), and every one
# of its published runs held more than the allocated peak plus the 5% assumed for other stacks.
TORCHTITAN_RESERVED = Sourced(
    0.136,
    "fitted on row tt2412-8b-8gpu-fsdp (torchtitan docs/performance.md, Dec 2024: Llama 3.1 8B "
    "on 8 x H100 96GB, FSDP, 82.4 GiB max_reserved against 72.5 GiB predicted allocated; the "
    "calibration row of validation/data/runs.toml): the caching allocator's reserve over the "
    "allocated peak in torchtitan's runs; every other torchtitan row's memory is a prediction",
)

TORCHTITAN = Stack(
    name="torchtitan",
    summary="PyTorch's torchtitan: FSDP2 (reshard after forward unless pipelined), op-level "
    "SAC, loss parallel, optional compile and Float8",
    source="pytorch/torchtitan models/llama3/infra/parallelize.py (apply_fsdp, _op_sac_save_list, "
    "apply_tp loss_parallel), config/job_config.py",
    kernels=Kernels(
        residual_fp32=False,
        vocab_parallel=True,
        loss_parallel=True,
        fp8_all_gathers=True,  # apply_tp's Float8ColwiseParallel, PrepareFloat8ModuleInput
    ),
    recompute=("none", "selective_op", "full", "every_k"),
    refusals=(
        (
            "selective",
            "torchtitan's selective AC is --recompute selective_op (op) or every_k (layer)",
        ),
    ),
    sharding="fsdp2_default",
    elementwise="torchtitan",
    grad_sync_once=False,
    fsdp_over_cp=True,
    # components/loss.py BaseLoss._maybe_compile (torch.compile(self.fn) when compile is on and
    # "loss" in compile.components, the default), as since bbb1b616 (2025-04-02); from
    # e8977b00 (2024-12-18) to then the loss ran eager (a run row of that time says so).
    compiles_loss=True,
    # torch's context_parallel: ALL_GATHER is `_cp_options.rotate_method`'s default (and the
    # default of the 2024 torchtitan's experimental.context_parallel_rotate_method).
    cp_rotate="allgather",
    allocator_overhead=TORCHTITAN_RESERVED,
    # training.enable_cpu_offload: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and
    # optimizer states on the host, the step there: torchtitan distributed/fsdp.py apply_fsdp),
    # which the llmscale runtime runs as "optimizer+params" under data parallelism.
    offloads=("none", "optimizer+params"),
    offload_flags="optimizer+params: --training.enable_cpu_offload",
    # One factor for every kernel torchtitan runs on a Hopper die's SMs (its cuBLAS GEMMs, FP8
    # GEMMs and SDPA flash attention; HBM bandwidth is each part's own figure): the share of
    # the catalog's assumed Hopper rates torchtitan reaches. Fitted on the 500 W H100 96GB, and
    # read as the software's, not that part's clocks: the same software on the 700 W parts runs
    # no faster per FLOP (the torchao README's 8-GPU Llama 3 8B on H100 SXM and Trainy's H200
    # rows, validation rows).
    fitted=tuple(
        Fit(gpu, HOPPER_SM_RATES, TORCHTITAN_HOPPER) for gpu in ("h100-96g", "h100", "h200")
    ),
)


STACKS: dict[str, Stack] = {s.name: s for s in (LLMSCALE, MEGATRON_2021, MEGATRON_CORE, TORCHTITAN)}
STACK_NAMES = tuple(STACKS)


def get_stack(name: str) -> Stack:
    """The stack called `name`, or a ConfigError listing them."""
    try:
        return STACKS[name]
    except KeyError:
        raise ConfigError("stack", name, " | ".join(STACK_NAMES)) from None


def stacks_help() -> str:
    """`--stack`'s help: every stack's one line."""
    return "; ".join(f"{s.name}: {s.summary}" for s in STACKS.values())


def offload_help() -> str:
    """`--offload`'s help: the modes, and which stacks run each (`Stack.offloads`)."""
    runs = "; ".join(f"{s.name}: {' | '.join(s.offloads)}" for s in STACKS.values())
    return f"optimizer offload: {' | '.join(OFFLOAD_MODES)} (by stack, {runs})"


def fitted_values(
    stack: Stack, gpu: str, precision: str, float8_recipe: str
) -> list[tuple[str, Sourced]]:
    """The values fitted on published runs that price a plan of `stack` on GPU `gpu`, each as
    (what it scales, the value with its source): the stack's factors on that GPU
    (`Stack.fitted`) and, under fp8, its recipe's GEMM share (`Stack.float8_gemm_shares`)."""
    out = []
    for fit in stack.fitted:
        if fit.gpu == gpu:
            what = (
                "SM rates" if fit.fields in (SM_RATES, HOPPER_SM_RATES) else ", ".join(fit.fields)
            )
            out.append((what, fit.scale))
    shares = dict(stack.float8_gemm_shares)
    if precision == "fp8" and float8_recipe in shares:
        out.append((f"{float8_recipe} GEMMs", shares[float8_recipe]))
    return out


# Where a user reads the fitted values with their rows (`fitted_note`'s pointer).
FITTED_VALUES_PAGE = "docs/planner-validation.md"


def fitted_note(
    stack: Stack, gpu: str, precision: str, float8_recipe: str, page: bool = True
) -> str | None:
    """One line naming `fitted_values` (and, with `page`, where they are listed), None when
    there are none."""
    parts = [f"{what} x{num.value:g}" for what, num in fitted_values(stack, gpu, precision,
                                                                     float8_recipe)]  # fmt: skip
    if not parts:
        return None
    where = f" ({FITTED_VALUES_PAGE})" if page else ""
    return f"fitted to published runs: {stack.name} on {gpu}, " + "; ".join(parts) + where


def float8_recipe_help() -> str:
    """`--float8-recipe`'s help: the recipes, what each is, and which stacks run each
    (`Stack.float8_recipes`)."""
    runs = "; ".join(f"{s.name}: {' | '.join(s.float8_recipes)}" for s in STACKS.values())
    return (
        "with --precision fp8, the float8 recipe (default tensorwise, one scale per tensor; "
        "torchao's rowwise scales each row, rowwise_with_gw_hp also keeps the weight gradient in "
        "bf16; mxfp8 is TransformerEngine's MXFP8 block scaling, on a GPU with an FP4 peak). By "
        f"stack: {runs}"
    )


# What each training precision is, for `--precision`'s help (which stacks run each is read from
# `Stack.precisions`).
PRECISION_MEANINGS = {
    "fp8": "FP8 linears (torchao's float8, or TransformerEngine's under megatron-core; "
    "--float8-recipe picks the scaling, mxfp8 among them)",
    "nvfp4": "TransformerEngine's NVFP4 recipe, on a GPU with an FP4 peak (llmscale hw)",
}


def precision_help(precisions: tuple[str, ...]) -> str:
    """`--precision`'s help: the choices, and for each one not every stack runs, what it is
    and which stacks run it."""
    notes = []
    for p in precisions:
        runs = [s.name for s in STACKS.values() if p in s.precisions]
        if len(runs) < len(STACKS) or p in PRECISION_MEANINGS:
            what = PRECISION_MEANINGS.get(p, p)
            notes.append(f"{p}: {what}, under --stack {' | '.join(runs)}")
    return f"{' | '.join(precisions)} (default bf16; " + "; ".join(notes) + ")"
