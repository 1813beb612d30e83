"""Structured configs: the schema of every setting, registered with Hydra's ConfigStore.

The CLI (`python -m metrale ...`) and the library (`Engine(...)`) both compose `conf/config.yaml`
through Hydra's compose API, so they see the same defaults. Nothing here reads env vars.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class Levers:
    """Tuning and bisecting knobs. Each is a typed field; presets live in conf/lever/."""
    no_mix: bool = False                 # run prefill chunks and decode rows in separate forwards
    cuda_graphs: bool = True             # replay decode steps as CUDA graphs
    overlap: bool = True                 # the host runs a step ahead: plain greedy decode steps are queued
                                         # before the last one's tokens are read (false: the synchronous loop)
    mixed_graphs: bool = True            # CUDA: replay prefill and mixed steps too, padded to bucketed
                                         # geometries (metrale/runtime/cuda/buckets.py; docs/runtime.md)
    warm_mixed: bool = True              # CUDA with mixed_graphs: compile at start-up the kernels every
                                         # token and rows bucket uses (cached on disk), so a new prompt
                                         # length never waits for a compile while serving
    compile_workers: int = 0             # CUDA: a start whose kernels are not in the disk cache yet compiles
                                         # them in this many processes at once (0: one at a time, in this one;
                                         # 8 becomes the default once its GPU test has run: docs/levers.md)
    sampling_split: bool = True          # CUDA: small steps' temperature / min-p rows (no top-k, top-p)
                                         # draw over spans of the row, a block each, not one block a row
                                         # (off until its GPU test and A/B have run: docs/levers.md)
    # decode batch sizes captured as CUDA graphs (a batch is padded to the next size)
    graph_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    gemv_max_rows: int = 256             # rows up to which linear layers stream the weights (GEMV /
                                         # streaming mma, kernels_numba/gemm.py) rather than tile
    gemm_library: str = "auto"           # auto | numba | cublaslt: who multiplies steps of many rows
                                         # (auto: cuBLASLt through nvmath-python when it loads)
    cublaslt_min_rows: int = 2           # rows from which gemm_library=auto/cublaslt calls cuBLASLt
                                         # (matrices under 4M elements: from 64 rows; docs/gemm.md)
    cublaslt_autotune: int = 8           # cuBLASLt candidates timed per decode-ladder shape (<= 256 rows)
    cublaslt_split_k: bool = True        # autotune may pick split-K candidates (false: one-kernel ones only)
                                         # at the first (eager) use; 0 or 1: the heuristic's first
    cublaslt_tune_cache: bool = True     # keep the autotune's picks on disk (~/.cache/metrale/cublaslt) and
                                         # take them at later starts instead of timing again
    prefix_caching: bool = True          # reuse KV blocks of identical prompt prefixes
    preempt_mode: str = "recompute"      # recompute | abort  (what happens to a preempted request)
    min_p_floor: bool = True             # raise min_p to the model's floor
    numpy_dtype: str = "float32"         # float32 | float64: arithmetic of the NumPy backend
    cpu_kernels: str = "numba"           # numba | numpy: device=cpu runs Numba CPU kernels on the weights as
                                         # stored (GGUF blocks stay quantized; metrale/runtime/cpu_ops.py) or
                                         # the float32 NumPy reference (weights expanded at load)
    cpu_threads: int = 0                 # Numba CPU kernels' threads (0: one per core)
    cpu_activations: str = "auto"        # auto | q8 | f32: products on GGUF blocks take activations quantized
                                         # to 8 bits a 32-block with integer dot products (as llama.cpp;
                                         # faster, less exact: docs/cpu.md)
                                         # or float32 ones (the reference's arithmetic); auto: q8 where the CPU
                                         # has AVX-512 VNNI or AVX2, else f32 (docs/cpu.md)
    weights: str = "bf16"                # bf16 | native: on CUDA, GGUF block-quantized matrices (and an FP8 e4m3
                                         # safetensors checkpoint's) are dequantized to bf16 at load, or stay in
                                         # their blocks / FP8 bytes on the device (quantized GEMV up to 8 rows, bf16
                                         # dequantized into a scratch beyond; docs/quant.md; native becomes the
                                         # default once its GPU tests have run). Other checkpoints and device=cpu
                                         # (levers.cpu_kernels; FP8 dequantized at load) unaffected
    quant_mma_rows: int = 1              # levers.weights=native: 1: linear Q4_K weights in the int8 tensor-core GEMV's
                                         # fragment layout, every product of up to 64 rows on it; R >= 2: planes
                                         # layout, Q4_K products of R to 8 rows on the planes' mma, fewer on dp4a;
                                         # 0: never (docs/quant.md)
    prefill_attention_min_tokens: int = 64  # segments this long use the tiled prefill kernel
    prefill_attention_kernel: str = "mma"   # mma (tensor cores, flash_prefill.py) | fma (FP32, attention.py)
    decode_attention_kernel: str = "mma"    # mma (tensor cores, flash_decode.py; H200: 2-2.9x at B>=128) | fma (attention.py)
    fuse_decode: bool = True             # one-row steps (CUDA): RMSNorm and silu*mul inside the next GEMV
    gemv_warps: int = 0                  # every one-row GEMV's warps a block (0: gemm.gemv_cfg's table)
    gemv_unroll: int = 0                 # every one-row GEMV's 16-byte loads in flight a row and lane (0: table)
    prefetch_o_proj: bool = True         # one-row steps (CUDA, with fuse_decode): the o_proj GEMV pulls its
                                         # weights into L2 before its PDL wait, during decode attention
    carry_norm_sums: bool = True         # one-row steps (CUDA, with fuse_decode): residual GEMVs sum the
                                         # squares for the next RMSNorm (float atomics: order-dependent
                                         # rounding; H200 8B B=1: 4.79 -> 4.58 ms a step)
    pdl: bool = True                     # CUDA sm_90+: programmatic dependent launch of the kernels that
                                         # opt in (the next kernel starts while the previous one drains)
    pdl_trigger: str = "auto"            # early | late | exit | auto: a PDL successor launches when the
                                         # kernel's blocks start (early), end their main loop (late) or
                                         # exit; auto: early for >= 1 GiB of weights, else exit


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    seed: Optional[int] = None
    ignore_eos: bool = False


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: Optional[int] = None     # None: sized from memory (gpu_memory_utilization / max_model_len)
    gpu_memory_utilization: float = 0.9
    cpu_kv_tokens: int = 65536           # KV tokens the NumPy backend allocates when num_blocks is None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048   # per-step token budget (prefill chunks + decode rows)
    max_model_len: Optional[int] = None  # None: the model's context length


@dataclass
class SpecGateConfig:
    """When a draft is worth its verify (metrale/spec/gate.py). These were the levers.spec_<name>
    levers, whose names are still accepted (settings.RENAMED; docs/levers.md, "Renamed")."""
    min_confidence: float = 0.0          # cut a draft at its first token below this confidence
    verify_cost: float = -1.0            # cost of one verified draft token, in plain decode steps
                                         # (-1: 0.1 on CUDA, where decode is memory-bound; the row model on
                                         # CPU; >= 0 pins this constant for every batch, prior 0.8)
    step_fixed: float = -1.0             # CPU row model: a forward of M >= 2 rows costs step_fixed +
    row_cost: float = -1.0               # row_cost * M one-row decode steps (-1: 2.45 and 0.1, measured
                                         # with NumPy/OpenBLAS; step_fixed 0: the constant model)
    draft_cost: float = -1.0             # the drafter's cost per draft token in target decode steps
                                         # (-1: its share of the target's weights; 0 for n-gram)
    prior_acceptance: float = -1.0       # a new sequence's per-token acceptance (-1: 0.8 n-gram, 0.5 draft
                                         # model, 0.3 self/mtp/dflash)
    min_gain: float = 1.1                # expected gain (tokens per step-equivalent) a draft needs under
                                         # the auto cost model (a margin for its error; 1 with a pinned
                                         # verify_cost)
    probe_budget: float = 0.01           # probes (verifies the cost model expects to lose) may lose at most
                                         # this share of a request's tokens (< 0: unbudgeted)
    probe_interval: int = 16             # steps a sequence stays unspeculated after a losing streak
    max_batch: int = 64                  # no speculation while more sequences than this decode
    ema_decay: float = 0.7               # weight of history in the accepted-tokens average
    measured: str = "auto"               # auto | on | off: pause speculation on measured step times
                                         # (auto: on CUDA backends; CPU uses the verify_cost model)
    measured_margin: float = 0.05        # the measured gate speculates on while its rate beats plain by this
    measured_min_steps: int = 4          # verify steps a batch-size bucket (or a probe) needs before deciding
    shadow: bool = True                  # free drafters (n-gram): where a verify is not expected to gain,
                                         # compare the draft with what the sequence emits instead of
                                         # probing (evidence without a verify)


@dataclass
class StateConfig:
    """Hybrid models' recurrent states (formerly levers.state_norm_bound / levers.state_snapshots)."""
    norm_bound: float = 0.0              # clamp recurrent-state norms in long prefills (0: off)
    snapshots: int = 64                  # recurrent-state snapshots kept for prefix caching
                                         # (LRU; 0: no prefix caching for hybrid models)


@dataclass
class SpecConfig:
    method: str = "none"                 # none | ngram | self | draft | mtp | dflash
    num_drafts: int = 4                  # most tokens proposed per step (the gate may use fewer)
    ngram_max_n: int = 4
    ngram_min_n: int = 1
    self_layers: Optional[int] = None    # layers of the target the self-speculative drafter runs (default: a third)
    draft_model: Optional[str] = None    # preset or path of the draft model (method=draft)
    mtp_head: Optional[str] = None       # MTP head .safetensors (method=mtp); None: the model's bundled head
    mtp_draft_vocab: bool = True         # use the MTP head's draft vocabulary (its d2t) when the file has one
    dflash_head: Optional[str] = None    # DFlash drafter .safetensors (method=dflash; block = num_drafts + 1);
                                         # None: the model's bundled drafter; "random": untrained (tests)
    gate: SpecGateConfig = field(default_factory=SpecGateConfig)


@dataclass
class ServerConfig:
    """`python -m metrale serve`: the OpenAI-compatible HTTP server (docs/server.md)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None        # if set, every route but /health needs "Authorization: Bearer <key>"
    served_model_name: Optional[str] = None   # the model id clients send; None: the `model` setting
    max_body_bytes: int = 8 * 1024 * 1024     # larger request bodies get 413
    shutdown_grace_s: float = 10.0       # on SIGINT/SIGTERM, in-flight requests get this long, then abort
    parse_reasoning: bool = True         # chat: text inside <think>...</think> goes to reasoning_content
    access_log: bool = False
    api_key_file: Optional[str] = None   # a file holding the API key (also: env METRALE_API_KEY); keeps it out of `ps`
    max_json_depth: int = 64             # request bodies nesting arrays/objects deeper get 400
    read_timeout_s: float = 30.0         # a request body not received within this gets 408
    header_timeout_s: float = 10.0       # a connection whose first request's headers take longer is closed
    allow_client_chat_template: bool = False   # let requests send their own Jinja chat template
    engine_process: bool = True          # `serve`: the engine in a process of its own (false: a thread of the server's)
    decode_in_server: bool = True        # with engine_process: the server process decodes plain requests' text
                                         # (token-id prompts, one completion, no stop strings); false: the engine does
    replicas: int = 0                    # `serve`: N engine replicas on Ray Serve behind this server (0: one engine, no Ray)
    replica_cpus: float = 1.0            # Ray CPUs reserved per replica
    replica_gpus: Optional[float] = None # Ray GPUs per replica; None: 1 with device=cuda, else 0
    ray_address: Optional[str] = None    # join this Ray cluster; None: start a local one


@dataclass
class ParallelConfig:
    """Several ranks for one model (docs/parallel.md)."""
    tensor: int = 1                      # tensor-parallel ranks (dense family; CPU ranks, or one GPU each with device=cuda)
    expert: int = 1                      # expert-parallel ranks (MoE families: 1/N of the routed experts each; CPU so far)


@dataclass
class MetraleConfig:
    model: str = "smollm2-135m"          # a preset of conf/models/ or a path (.gguf file or HF directory)
    device: str = "auto"                 # auto | cpu | cuda
    prompt: str = "The meaning of life is"
    max_tokens: int = 64
    chat: bool = False
    system: Optional[str] = None
    stream: bool = True
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    levers: Levers = field(default_factory=Levers)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    state: StateConfig = field(default_factory=StateConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0
    log_level: str = "WARNING"
    extra: dict[str, Any] = field(default_factory=dict)


# Settings with a fixed set of values (the runtime reads them as given). log_level: any case.
CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda"),
    "log_level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    "levers.gemm_library": ("auto", "numba", "cublaslt"),
    "levers.preempt_mode": ("recompute", "abort"),
    "levers.numpy_dtype": ("float32", "float64"),
    "levers.cpu_kernels": ("numba", "numpy"),
    "levers.cpu_activations": ("auto", "f32", "q8"),
    "levers.weights": ("native", "bf16"),
    "levers.prefill_attention_kernel": ("mma", "fma"),
    "levers.decode_attention_kernel": ("mma", "fma"),
    "levers.pdl_trigger": ("auto", "early", "late", "exit"),
    "spec.gate.measured": ("auto", "on", "off"),
    "spec.method": ("none", "ngram", "self", "draft", "mtp", "dflash"),
}

# Integer settings with a lower bound (None, where the schema allows it, is always fine).
MINIMUMS: dict[str, int] = {
    "cache.block_size": 1, "cache.num_blocks": 1, "cache.cpu_kv_tokens": 1,
    "scheduler.max_num_seqs": 1, "scheduler.max_num_batched_tokens": 1, "scheduler.max_model_len": 1,
    "spec.num_drafts": 1, "spec.ngram_min_n": 1, "spec.ngram_max_n": 1, "spec.self_layers": 1,
    "levers.gemv_max_rows": 0, "levers.cublaslt_min_rows": 0, "levers.cublaslt_autotune": 0,
    "levers.gemv_warps": 0, "levers.gemv_unroll": 0, "levers.prefill_attention_min_tokens": 0,
    "spec.gate.probe_interval": 0, "spec.gate.max_batch": 0, "spec.gate.measured_min_steps": 0,
    "state.snapshots": 0, "levers.cpu_threads": 0, "levers.compile_workers": 0,
    "server.replicas": 0,
    "parallel.tensor": 1, "parallel.expert": 1,
}


def invalid_setting(cfg: Any) -> str | None:
    """The first setting of a composed config outside its values ('name: why, valid ...'), or None."""
    def get(dotted: str) -> Any:
        node = cfg
        for part in dotted.split("."):
            node = node[part] if part in node else None
            if node is None:
                return None
        return node

    for name, valid in CHOICES.items():
        value = get(name)
        shown = str(value).upper() if name == "log_level" else value
        if shown not in valid:
            return f"{name}: '{value}' is not one of {', '.join(valid)}"
    for name, low in MINIMUMS.items():
        value = get(name)
        if value is not None and value < low:
            return f"{name}: must be >= {low}, got {value}"
    sizes = get("levers.graph_batch_sizes") or []
    if any(b < 1 for b in sizes):
        return f"levers.graph_batch_sizes: every size must be >= 1, got {list(sizes)}"
    util = get("cache.gpu_memory_utilization")
    if util is not None and not 0.0 < util <= 1.0:
        return f"cache.gpu_memory_utilization: must be in (0, 1], got {util}"
    if get("spec.ngram_min_n") > get("spec.ngram_max_n"):
        return f"spec.ngram_min_n: must be <= spec.ngram_max_n ({get('spec.ngram_max_n')}), got {get('spec.ngram_min_n')}"
    return None


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="metrale_schema", node=MetraleConfig)
    cs.store(group="lever", name="lever_schema", node=Levers, package="levers")
