"""Every config dataclass of kimik3: the single source of defaults and types.

Hydra composes `conf/` into these schemas (registered in `config/store.py`), so a misspelt key or
a wrong type fails at compose time, before anything is built. YAML files only select and override
values. Cross-field rules (device vs precision, seq_len vs chunk size, ...) live in
`config/validate.py`. Nothing past `train.py` sees a DictConfig: code receives these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

# Choice fields are plain strings (readable in YAML and on the command line); their accepted
# values are listed here once and checked in validate.py with a one-line error.
MODEL_ARCHS = ("smoke_test_lm", "kimi_k3")
KDA_IMPLEMENTATIONS = ("naive", "chunk", "triton", "fla")
GATE_FORMS = ("softplus", "bounded")
LAYER_TYPES = ("kda", "mla")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
PRECISIONS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
PARALLELISMS = ("none", "ddp", "fsdp")
LOGGERS = ("auto", "tensorboard", "none")
OBJECTIVES = ("val_loss", "train_loss")
DATA_END_POLICIES = ("next_epoch", "stop")
TOKENIZERS = ("byte", "bpe")


@dataclass
class ModelConfig:
    """Architecture of the model. `arch` picks the builder in `models/__init__.py`."""

    arch: str = "kimi_k3"
    """smoke_test_lm (embedding + head, a plumbing check only) or kimi_k3 (KDA/MLA hybrid + MoE)."""
    name: str = "kimi_k3"
    """Preset name, recorded in run.json; the config group option that produced it."""
    vocab_size: Optional[int] = None
    """None takes the prepared dataset's vocab; a number must equal it."""
    max_seq_len: int = 4096
    """Longest sequence the model accepts (train.seq_len must not exceed it)."""
    hidden_size: int = 256
    num_layers: int = 4
    layer_types: Optional[List[str]] = None
    """Explicit per-layer mixer list ('kda'/'mla'); None derives it from mla_every."""
    mla_every: int = 4
    """Without layer_types: every mla_every-th layer (1-based) and the last layer are MLA.
    0 means KDA only; 1 means MLA only."""
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    """Std of weight init; output projections are further scaled by 1/sqrt(2*num_layers)."""
    z_loss_weight: float = 0.0
    """Weight of the logit z-loss (log-sum-exp squared); 0 disables it."""

    # --- KDA (Kimi Delta Attention) ---
    num_heads: int = 4
    """KDA heads."""
    head_dim: int = 64
    """KDA key/value head dim."""
    kda_implementation: str = "chunk"
    """naive (token recurrence, the oracle), chunk (PyTorch chunkwise), triton (fused, CUDA), fla."""
    kda_chunk_size: int = 64
    conv_size: int = 4
    """Kernel of the causal depthwise short convolution on q, k, v."""
    gate_form: str = "softplus"
    """softplus: g = -exp(A_log) * softplus(f + dt_bias); bounded: g = lb * sigmoid(exp(A_log) * (f + dt_bias))."""
    gate_lower_bound: float = -5.0
    """lb of the bounded gate form."""

    # --- MLA (multi-head latent attention) ---
    mla_num_heads: Optional[int] = None
    """MLA heads; None uses num_heads."""
    q_lora_rank: Optional[int] = None
    """None: full-rank query projection."""
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    """Shared key part; NoPE unless mla_use_rope."""
    v_head_dim: int = 64
    mla_use_rope: bool = False
    rope_theta: float = 10000.0
    mla_output_gate: bool = False

    # --- FFN / MoE ---
    intermediate_size: int = 512
    """Dense SwiGLU width (dense layers and the first_k_dense layers)."""
    num_experts: int = 8
    """0 makes every FFN dense."""
    top_k: int = 2
    num_shared_experts: int = 1
    moe_intermediate_size: int = 128
    first_k_dense: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    """Expert groups for group-limited routing (top-k groups first); 1 disables it."""
    topk_group: int = 1
    bias_update_rate: float = 1e-3
    """Aux-loss-free balancing: router bias moves by this much per optimizer step."""
    aux_loss_weight: float = 0.0
    """Sequence-level balance loss weight; 0 disables it."""

    # --- Weights ---
    init_from: Optional[str] = None
    """A transformers Kimi Linear dir or a kimik3 checkpoint to initialise weights from."""


@dataclass
class ProfileConfig:
    """torch.profiler window, counted in optimizer attempts (skipped updates count)."""

    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 2


@dataclass
class TrainConfig:
    """The training recipe: batching, budget, optimizer, schedule, runtime."""

    batch_size: int = 8
    """Sequences per micro-batch (per rank)."""
    seq_len: int = 256
    grad_accum_steps: int = 1
    max_steps: int = 200
    """Optimizer steps to run (attempts, skipped ones included)."""
    max_tokens: Optional[int] = None
    """Token budget; when set, training stops at whichever of max_steps / max_tokens comes first."""

    optimizer: str = "adamw"
    lr: float = 3e-3
    """Peak learning rate (AdamW groups; Muon uses it too, with RMS matching)."""
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"
    warmup_steps: int = 20
    decay_fraction: float = 0.2
    """WSD: fraction of max_steps spent in the final decay."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: Optional[float] = 1.0
    """Global grad-norm clip; None disables it."""
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_rms_scale: float = 0.2
    """Muon update RMS is matched to AdamW: scale * sqrt(max(fan_out, fan_in))."""
    muon_per_head: bool = False
    """Orthogonalise attention projections per head instead of as one matrix."""
    qk_clip_threshold: Optional[float] = 100.0
    """QK-Clip tau for MLA layers; None disables it."""

    precision: str = "auto"
    """auto: bf16 autocast on a CUDA device with bf16, else fp32; bf16: autocast (on CPU too: correct but
    slow); fp32: no autocast. The resolved value is printed and recorded in run.json."""
    device: str = "auto"
    seed: int = 1337
    deterministic: bool = False
    compile: bool = False
    """Regional torch.compile of each block."""
    activation_checkpointing: bool = False
    recompute_conv: bool = True
    """On CUDA, the KDA op's inputs q, k, v (the short conv's outputs) are not kept for the backward but
    recomputed there by one more conv pass: -2.25 GiB at kda_dense_1b T=8192 for ~1% step time."""
    recompute_kda_states: Optional[bool] = None
    """With the Triton KDA kernels: true recomputes each 64-token chunk's start state in the backward by
    one more pass of the recurrence; false keeps it from the forward ([T / 64, H, K, V] in bf16 per KDA
    layer: 64 MiB at T=8192 x 16 heads) and skips that pass, with the same gradients bit for bit; null
    (auto) keeps it while it takes at most models.kda.KEEP_KDA_STATES_MAX_BYTES (128 MiB) per layer of
    a micro-batch: kda_dense_1b keeps up to 16K tokens (2.6% faster at 8K for +1.44 GiB on the H100)
    and recomputes at 32K, where keeping would cost ~6 GiB."""
    recompute_experts: bool = True
    """With the MoE's grouped GEMMs (CUDA sm90+, bf16), the dispatched token rows and the bf16 expert
    weights they save are not kept but rebuilt in backward (a gather and two casts per layer):
    ~470 MB per MoE layer of kimi_3b_a1b at T=8192."""
    parallel: str = "none"
    """none, ddp or fsdp (under torchrun)."""

    eval_interval: int = 50
    eval_steps: int = 4
    log_interval: int = 10
    checkpoint_interval: int = 100
    """Optimizer steps between checkpoints; the last step always saves."""
    overfit_batch: bool = False
    """Repeat one fixed batch, the train split's first (grad_accum_steps micro-batches; the same one after
    a resume): a debugging aid, the loss should go to ~0."""
    data_end: str = "next_epoch"
    """When the train split ends: next_epoch (rewind, logged) or stop."""
    resume: Optional[str] = None
    """Checkpoint path (or run dir) to resume from."""
    logger: str = "auto"
    """auto: TensorBoard when installed; tensorboard; none."""
    objective: str = "val_loss"
    """What the Hydra task returns to a sweeper."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)


@dataclass
class DataConfig:
    """Where tokens come from and where the prepared shards live."""

    source: Optional[str] = None
    """Text file, folder of text files, or .jsonl; None = the embedded corpus (Python stdlib sources)."""
    prepared_dir: Optional[str] = None
    """Prepared dir to use (or to create from `source`); None = a cache dir keyed by source+tokenizer."""
    cache_dir: Optional[str] = None
    """Root of auto-prepared dirs; None = $KIMIK3_CACHE or ~/.cache/kimik3."""
    tokenizer: str = "byte"
    """byte (no download) or bpe (Hugging Face tokenizers, trained locally or loaded)."""
    tokenizer_path: Optional[str] = None
    """A tokenizer.json to load for bpe; None trains one on the corpus."""
    bpe_vocab_size: int = 8192
    text_field: str = "text"
    """JSONL field holding the text."""
    val_fraction: float = 0.05
    shard_tokens: int = 16_777_216
    """Tokens per shard file."""
    max_source_bytes: Optional[int] = None
    """Read at most this many UTF-8 bytes of the source (None: all of it; for the embedded corpus
    None means its default cap, kimik3.data.corpus.EMBEDDED_MAX_BYTES = 8 MiB)."""


@dataclass
class PrepareConfig:
    """What `kimik3-prepare` runs: composed from conf/prepare.yaml (the data group only)."""

    data: DataConfig = field(default_factory=DataConfig)


@dataclass
class RootConfig:
    """What `kimik3-train` runs: composed by Hydra from conf/train.yaml and overrides."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
