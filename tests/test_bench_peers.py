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
