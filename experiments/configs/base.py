"""Every training config field, documented; the defaults are the CPU `gpt_tiny` run (other configs start here)."""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
    """The default config (= gpt_tiny); `--config.<field>=...` overrides any field."""
    c = ml_collections.ConfigDict()
    c.task = "lm"  # model family (experiments/tasks.py): "lm" (GPT on tokens) | "image_classification" (ResNet)
    c.config_name = "gpt_tiny"  # names the run dir (<run_dir>/<config_name>-<strategy>) unless `name` is set
    c.name = ""  # run name; "" = "<config_name>-<strategy>". An existing run dir is resumed.
    c.run_dir = "runs"  # metrics.jsonl, config.json and checkpoints/ go to <run_dir>/<name>/
    c.init_from = ""  # "hf:<dir>": start from a local Hugging Face Llama / Mistral / Qwen2 folder (its config.json
    #                  sets the architecture; of `model` only dtype, param_dtype, remat, ... apply; docs/models.md)

    # --- hardware and parallelism
    c.hardware = "cpu8"  # preset in meshes/ (peak FLOP/s for MFU, HBM); "auto" = match jax.devices()
    c.target = ""  # hardware that need not be present: a TPU slice ("v5e-8", "v5p-128", "v6e-256", "v4-32",
    #                "v5e-8x2" = 2 slices): the mesh is built on its compile-only devices (shardkit/targets.py); needs
    #                compile_only (nothing can run there) and libtpu (pip install "jax[tpu]"); docs/targets.md
    c.compile_only = False  # compile the train step (abstract state and batch: no data, no parameters), print
    #                         explain's report and whether it fits in HBM, exit 0 if it fits, 1 if not
    c.save_executable = ""  # compile_only: also write the serialized executable to this path
    c.peak_flops = 0.0  # per-device peak FLOP/s override; 0 = the preset's (measured at start-up on CPU)
    c.mesh = "auto"  # "auto": a mesh the strategy fits (fsdp: data=2,fsdp=4 on 8 devices; printed); "axis=degree,..."
    #                  (one degree may be -1), a preset name, or "" = the preset's mesh
    c.strategy = "fsdp"  # dp | zero1 | fsdp | tp | tp_sp | fsdp_tp | dp_fsdp_tp | pp* | sdp (shardkit/strategies.py)
    #                    | auto: the planner picks strategy, mesh and remat policy, compiles its top candidates and
    #                      trains the fastest that fits (experiments/auto.py; run dir <config_name>-auto)
    c.auto = ml_collections.ConfigDict()  # strategy=auto only
    c.auto.top = 3  # candidates compiled (in the planner's order); the lowest compiled estimate that fits trains
    c.auto.memory_fraction = 0.9  # of the preset's hbm_bytes (cpu8: a nominal 3.0 GB per virtual device)
    c.auto.remat = "none,dots,dots_no_batch,full"  # remat policies the planner tries per plan (sk.plan(remat=))
    c.auto.efficiency = 0.5  # fraction of peak the planner assumes recompute runs at (its ranking, not the pick)
    c.strict_names = False  # True: refuse parameters with fewer logical names than dimensions, or none (default:
    #                          Flax's meaning, the rest replicated; docs/flax_models.md)
    c.kernels = ""  # kernel slots over the strategy's: "slot=name,..." e.g. "norm=group" (per-group BatchNorm),
    #                 "conv=halo,pool=halo", "attention=ring:zigzag" (shardkit/kernels.py; listed when one is unknown)
    c.offload = ""  # "", "opt_state", "params", "opt_state,params": rests in host memory between steps, brought to
    #                 the devices by the step (ZeRO-Offload; GSPMD strategies; shardkit/offload.py, docs/memory.md)
    c.sdp = ml_collections.ConfigDict()  # strategy=sdp only: subnetwork data parallelism (shardkit/parallel/sdp/)
    # (its workers are the `data` coordinates; fsdp / tensor in the mesh split each worker: --config.mesh=data=4,fsdp=2)
    c.sdp.granularity = "block"  # block (whole layers of a stack) | neuron (groups of hidden units, `units`)
    c.sdp.coverage = 0.5  # fraction of the blocks (or unit groups) each worker holds; a multiple of 1/blocks
    c.sdp.masking = "forward"  # forward (subnetwork alone; memory = coverage) | backward (full forward, masked grads)
    c.sdp.ownership = "cyclic"  # cyclic (equal holder counts, ring averaging) | random (seeded, masked all-reduce)
    c.sdp.seed = 0  # ownership="random"'s seed
    c.sdp.units = ""  # the split logical name: "" = layers (block) / mlp (neuron)
    c.sdp.groups = 0  # neuron: unit groups per layer; 0 = one per worker
    c.sdp.reduce = "auto"  # holder averaging: auto | ring | psum
    c.sdp.eval = "subnetworks"  # forward masking's validation: subnetworks (what trained) | full (every block)
    c.hetero = ml_collections.ConfigDict()  # strategy=hetero_dp only: uneven data parallelism (parallel/hetero/)
    c.hetero.microbatch = 1  # examples per micro-batch; device d runs counts[d] of them (batch_size / microbatch)
    c.hetero.speeds = ""  # "2,2,1,1,..." relative throughputs; "" = the mesh preset's [[groups]]
    c.hetero.microbatch_bytes = 0.0  # memory one micro-batch needs, for per-device caps; 0 = uncapped
    c.hetero.balance = True  # False: the even split, to compare
    c.hetero.mode = "loop"  # loop (per-device trip counts) | pad (every device max(counts), padding masked)
    # A model with BatchNorm runs every device's max(counts) slots in one pass (statistics over the global batch,
    # as one device); --config.kernels=norm=group keeps the loops, with per-micro-batch statistics (docs/hetero.md)
    c.microbatches = 1  # gradient accumulation: batch_size is split into this many sequential microbatches
    c.pipeline = ml_collections.ConfigDict()  # pp* strategies only (shardkit/pipeline.py); not accumulation
    c.pipeline.schedule = "gpipe"  # gpipe | 1f1b | circular
    c.pipeline.microbatches = 4  # pipeline microbatches per step (1f1b and circular need >= the stage count)
    c.pipeline.virtual_stages = 0  # layer chunks per stage device (circular only); 0 = 2 for circular, else 1
    c.pipeline.stage_layers = ""  # layers per stage (gpipe, 1f1b): "" = even (num_layers / stages); "3,5" = stage 0
    #                               holds 3, stage 1 holds 5 (one count >= 1 per stage, summing to num_layers);
    #                               "hetero" = the min-max cut over the stages' device speeds from the hardware
    #                               preset's [[groups]] (e.g. hardware=hetero_v100_p100, mesh=stage=2,data=4: stage 0
    #                               on the V100s gets 5 of 8 layers). The cut is printed with the strategy.
    c.cpu_devices = 8  # virtual CPU devices (XLA_FLAGS) when running on CPU; ignored on accelerators
    c.distributed = False  # multi-process: call jax.distributed.initialize() (also if JAX_COORDINATOR_ADDRESS is set)

    # --- model: models.gpt.GPTConfig fields
    c.model = ml_collections.ConfigDict()
    m = c.model
    m.vocab_size = 0  # 0 = from the data (257 bytes + EOT -> padded to 384)
    m.num_layers = 4
    m.d_model = 128
    m.num_heads = 4
    m.num_kv_heads = 4  # GQA when < num_heads; tensor parallelism needs it divisible by the tensor degree
    m.head_dim = 32
    m.mlp_dim = 512
    m.max_seq_len = 0  # 0 = seq_len
    m.rope_theta = 10_000.0
    m.tie_embeddings = False
    m.norm_eps = 1e-6
    m.dtype = "float32"  # compute dtype; "bfloat16" on accelerators (params and optimizer stay float32)
    m.param_dtype = "float32"
    m.remat = "none"  # none | full | dots
    m.init_std = 0.02
    # None (auto): from the mesh's devices, on a TPU or GPU with bf16 compute the lean head (docs/performance.md,
    # "Lean by default on a target"); on the CPU, fp32 logits and the whole loss
    m.logits_dot_in_fp32 = config_dict.placeholder(bool)  # False: the head's dot in the compute dtype, cast to fp32
    #                              for the loss (MaxText's default; halves the bf16 head's logits and gradient traffic)
    m.loss_chunk = config_dict.placeholder(int)  # > 0: the output head and the loss over this many positions at a
    #                   time, each chunk's gradients computed in the forward: no [batch, seq, vocab] logits buffer,
    #                   no extra FLOPs (must divide seq_len); 0 = whole
    m.num_experts = 0  # > 0: every block's MLP is a mixture of this many experts (strategy ep / ep_gspmd)
    m.top_k = 2  # experts per token: 1 Switch, 2 GShard
    m.capacity_factor = 1.25  # expert capacity per sequence = ceil(top_k x seq_len x factor / experts)
    m.dropless = False  # capacity = seq_len: no token dropped
    m.aux_loss_weight = 0.01  # load-balancing loss weight (the loss is 1.0 when balanced)
    m.z_loss_weight = 1e-3  # router z-loss weight

    # --- optimizer: AdamW, linear warmup then cosine decay, global-norm clipping
    c.optimizer = ml_collections.ConfigDict()
    o = c.optimizer
    o.name = "adamw"
    o.lr = 3e-3  # peak learning rate
    o.warmup_steps = -1  # linear warmup steps; -1 = min(30, schedule length // 10), so short runs work too
    o.decay_steps = 0  # length of warmup + cosine; 0 = steps
    o.min_lr_ratio = 0.1  # final lr = lr * min_lr_ratio
    o.b1 = 0.9
    o.b2 = 0.95
    o.eps = 1e-8
    o.weight_decay = 0.1  # decoupled; not applied to norm scales
    o.grad_clip = 1.0  # clip the global gradient norm to this (0 = off)

    # --- data (experiments/data/text.py): byte tokens of the Python stdlib unless data.path is set
    c.data = ml_collections.ConfigDict()
    c.data.path = ""  # text file / directory / glob, nanoGPT dir with train.bin+val.bin, a .bin file, or a folder
    #                   written by `python -m experiments.data.prepare` (manifest.json: experiments/data/tokens.py)
    c.data.documents = True  # prepared data: segment ids and positions from its end-of-document tokens (attention and
    #                          RoPE positions never cross a document); False = windows attend across documents
    c.data.bin_dtype = "uint16"  # token dtype of .bin files
    c.data.cache_dir = ""  # tokenised-text cache; "" = ~/.cache/shardkit/data
    c.data.max_files = 0  # use only the first N text files (0 = all)

    # --- schedule of the run
    c.batch_size = 32  # global batch (sequences per step, over all devices and microbatches)
    c.seq_len = 128
    c.steps = 300
    c.seed = 0  # parameter init and data order
    c.eval_every = 50  # validation loss every N steps (and at the end); 0 = only at the end
    c.eval_batches = 4  # fixed validation windows: eval_batches x batch_size
    c.ckpt_every = 100  # checkpoint every N steps (and at the end / on SIGTERM, SIGINT); 0 = only then
    c.keep = 3  # checkpoints kept (oldest deleted after a newer one commits)
    c.async_checkpointing = True  # write checkpoints in a background thread
    c.emergency_every = -1  # emergency checkpoints: each process's own shards to local disk every N steps, restored
    #                         when newer than the last checkpoint on the same mesh (shardkit/emergency.py); -1 = 10
    #                         when the run has several processes, else off; 0 = off
    c.emergency_dir = ""  # where ("" = <run>/emergency; a node-local disk on a cluster), one p<K>/ per process
    c.watchdog = "auto"  # a step that takes longer ends the run, stacks to <run>/logs/ (experiments/watchdog.py):
    #                      "auto" = max(300 s, 20 x the median step), seconds, or "off"
    c.supervise = True  # multi-process: train under a supervising parent that turns a dead peer's abort into one
    #                     `error:` line and exit 75, the rest to <run>/logs/ (experiments/supervise.py)
    c.heartbeat_timeout = 60  # multi-process: seconds without a heartbeat before JAX declares a peer dead
    c.log_every = 10  # without a terminal (logs, CI): one progress line every N steps
    c.profile = ml_collections.ConfigDict()  # a jax.profiler trace (experiments/profiling.py); off by default
    c.profile.start_step = 10  # the trace starts after this many steps (past the compile and the warm-up)
    c.profile.steps = 0  # steps traced, into <run>/profile/p<K>/ (TensorBoard's profile plugin, Perfetto); 0 = off
    c.profile.all_processes = False  # every process traces its own devices, not process 0 only
    c.tensorboard = True  # metrics.jsonl's records (and goodput) also as TensorBoard events in <run>/tb (process 0)
    c.progress = True  # tqdm bar when stderr is a terminal
    c.jax_cache_dir = "~/.cache/shardkit/jax"  # persistent compile cache ("" = off); kept if already configured
    return c
