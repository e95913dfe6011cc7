"""The benchmarks, one module each: `python -m experiments.bench.bench_<name> [--help]`, results in bench/results/.

    bench_4d          4D (AxoNN) tensor parallelism: predicted vs compiled collective bytes, step time, planner picks
    bench_attention   context-parallel attentions: memory, time, causal balance, a peer kernel
    bench_compile     compile time against depth; start-up with a cold and a warm compile cache
    bench_gpu         the prepared one-GPU check: train step time, MFU, peak memory, attention kernels
    bench_hetero      heterogeneous devices: work saved (measured) and speed-ups (simulated)
    bench_mfu         model FLOP utilisation and where a step's time goes
    bench_moe         mixture of experts: expert-parallel formulations, memory, dropping, the loss
    bench_pipeline    pipeline schedules: step time, bubble, temporaries
    roofline_maxtext  the PREDICTED step time / MFU of a target's program beside an MFU MaxText publishes
    bench_sdp         subnetwork data parallelism against dp and fsdp
    bench_spatial     spatial parallelism for 3D CNNs: memory vs degree, explicit vs GSPMD halos, planning
    bench_strategies  every built-in strategy: state and temp memory, collective bytes, step time

`timing` is what they share: the compile-and-time loop, the GPT batch, the JSON writer.
"""
