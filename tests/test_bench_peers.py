"""experiments/bench/bench_peers.py without MaxText: MaxText is not a dependency (it needs Python >= 3.12 and its
own JAX), so the benchmark must say how to install it and record "missing" rather than fail. Its timings are
the benchmark's to print; no test asserts one."""

import json


def test_the_maxtext_benchmark_says_how_to_install_maxtext_when_it_is_missing(tmp_path, capsys):
    from experiments.bench import bench_peers

    out = tmp_path / "peers.json"
    bench_peers.main(["--maxtext-python", str(tmp_path / "no-venv" / "python"), "--out", str(out)])
    assert 'pip install "maxtext[tpu]==0.2.5"' in capsys.readouterr().out
    assert json.loads(out.read_text())["maxtext"] == "missing"


def test_the_peer_tables_leave_out_what_the_cuda_compiler_does_not_report_and_divide_the_named_pairs():
    """On a GPU target neither side has a cost analysis (HBM bytes None): the markdown drops that row, and each
    ratio column is the pair it names (shardkit's default against MaxText's default and its XLA attention)."""
    from experiments.bench.peers_tpu import markdown

    side = lambda peak, coll: dict(peak=peak, temp=peak / 2, hbm_bytes_accessed=None, matmul_flops=4e12,
                                   collective_bytes=coll)  # fmt: skip
    cells = {"fsdp, remat full (x)": {"shardkit default": side(3 * 2**30, 100e6), "maxtext dot_product":
                                      side(2 * 2**30, 50e6), "maxtext": side(4 * 2**30, 400e6)}}  # fmt: skip
    pairs = (("shardkit default", "maxtext"), ("shardkit default", "maxtext dot_product"))
    rows = markdown(cells, ("shardkit default", "maxtext dot_product"), pairs).splitlines()
    assert rows[0].endswith("| default / MaxText | default / MaxText dot_product |")
    assert not any("hbm_bytes_accessed" in r for r in rows)
    peak = next(r for r in rows if "| peak |" in r)
    assert peak.endswith("| 3.000 GiB | 2.000 GiB | 4.000 GiB | **0.75x** | **1.50x** |")
