"""Traces, TensorBoard events and goodput of a training run (issue 53 items 4-5), on CPU, in process.

A tiny GPT trains 4 steps with a trace of steps 2-3: the profiler's files exist and parse (the top ops line names
XLA ops), the TensorBoard events hold metrics.jsonl's records (read back from the event files with tensorboardX's
own protobuf classes), and goodput.json sums the attempts of a resumed run, whose TensorBoard writer raises: it
stops writing with one warning while training finishes. An unwritable profile directory is one ShardkitError
before training.
"""

import json
import struct
from pathlib import Path

import pytest
from test_experiments import make_config, metrics

import shardkit as sk
from experiments import goodput, profiling
from experiments import train as tr


def _events(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the TensorBoard event files under `folder` (TFRecord framing:
    length, its CRC, the serialized Event, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    for path in folder.glob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_a_profiled_run_writes_a_trace_tensorboard_events_and_goodput_summed_across_resumes(
    tmp_path, capsys, monkeypatch
):
    config = make_config(tmp_path, "seen", steps=4, eval_every=0, ckpt_every=2,
                         **{"profile.start_step": 1, "profile.steps": 2})  # fmt: skip
    first = tr.train(config)
    run = Path(first["run_dir"])
    said = capsys.readouterr().out
    line = next(ln for ln in said.splitlines() if ln.startswith("profile: steps 2-3 in "))
    assert "top ops: " in line and "% (" in line, line  # named ops with their share
    top, total = profiling.top_ops(run / "profile" / "p0")
    assert total > 0 and top and all(t > 0 for _, t in top)
    chrome = profiling.latest_trace(run / "profile" / "p0", ".trace.json.gz")  # Perfetto's file
    by_json = {}
    for name, seconds in profiling._op_events_json(chrome):  # the other format, read on its own: the same ops
        by_json[name] = by_json.get(name, 0.0) + seconds
    assert sum(by_json.values()) == pytest.approx(total, rel=1e-6)
    assert all(by_json[name] == pytest.approx(t, rel=1e-6) for name, t in top)
    # TensorBoard: metrics.jsonl's records, step by step
    recs, events = metrics(run), _events(run / "tb")
    for key in ("loss", "lr", "grad_norm", "step_time", "tokens_per_s", "mfu"):
        assert sorted(events[f"train/{key}"]) == sorted(recs), key
        for k, rec in recs.items():
            assert events[f"train/{key}"][k] == pytest.approx(rec[key], rel=1e-6)  # stored as float32
    assert events["val/loss"][4] == pytest.approx(recs[4]["val_loss"], rel=1e-6)
    first_goodput = json.loads((run / "goodput.json").read_text())["goodput"]
    assert events["goodput/goodput"][4] == pytest.approx(first_goodput, rel=1e-6)
    # the resume, with a TensorBoard writer that fails (a full disk): one warning, and training goes on
    import tensorboardX

    def broken(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tensorboardX.SummaryWriter, "add_scalar", broken)
    config.steps = 6
    assert tr.train(config)["step"] == 6 and sorted(metrics(run)) == list(range(1, 7))
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if "TensorBoard events" in ln]
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "training goes on" in warnings[0]
    # goodput: written at the end of every attempt, summed across them
    saved = json.loads((run / "goodput.json").read_text())
    assert [a["steps"] for a in saved["attempts"]] == [[0, 4], [4, 6]]
    second = saved["attempts"][1]
    assert second["restart"] > 0 and second["compile"] == 0  # a resume's start-up and compile are restart time
    assert saved["total"]["wall"] == pytest.approx(sum(a["wall"] for a in saved["attempts"]), abs=0.01)
    assert 0 < saved["goodput"] < 1 and saved["total"]["step"] > 0 and saved["total"]["checkpoint"] > 0
    parts = sum(saved["total"][b] for b in goodput.BUCKETS)
    assert parts == pytest.approx(saved["total"]["wall"], abs=0.05)  # the buckets split the wall time


def test_an_unwritable_profile_directory_is_one_error_before_training(tmp_path):
    """A file where the profile folder goes: no one can write there, root included (permissions would not stop
    root, who runs this suite in some containers)."""
    config = make_config(tmp_path, "noprof", steps=2, **{"profile.steps": 1})
    (tmp_path / "runs" / "noprof").mkdir(parents=True)
    (tmp_path / "runs" / "noprof" / "profile").write_text("not a folder")
    with pytest.raises(sk.ShardkitError, match=r"profile directory .*noprof/profile/p0 cannot be written \("):
        tr.train(config)
    assert not (tmp_path / "runs" / "noprof" / "metrics.jsonl").exists()
