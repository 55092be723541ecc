"""bench/plot_context.py: the speed-up over Dense against L, read from throughput.py result files."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import plot_context  # noqa: E402


def _result(seq_len, ratios, device="2-core CPU", backbone="cpu-256"):
    """A throughput.py result as it writes one: meta, and a row per model with its ratios to Dense."""
    rows = [dict(model="dense", train_ratio=1.0, ideal_ratio=1.0)]
    rows += [dict(model=model, train_ratio=ratio, ideal_ratio=ideal) for model, (ratio, ideal) in ratios.items()]
    return dict(meta=dict(seq_len=seq_len, device=device, backbone=dict(name=backbone)), rows=rows)


def test_speedups_follow_the_length_of_each_file_and_leave_dense_out(tmp_path):
    results = [_result(16384, {"xmod-a4k8": (1.84, 2.19)}), _result(2048, {"xmod-a4k8": (0.98, 1.51), "mod": (0.97, 1.06)}),
               _result(8192, {"xmod-a4k8": (1.66, 2.00)})]
    lines = plot_context.speedups(results)
    assert lines == {"xmod-a4k8": [(2048, 0.98, 1.51), (8192, 1.66, 2.00), (16384, 1.84, 2.19)],
                     "mod": [(2048, 0.97, 1.06)]}
    plot_context.plot(results, tmp_path / "context.png")
    assert (tmp_path / "context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("field, other", [("device", dict(device="H100")), ("backbone", dict(backbone="298m"))])
def test_runs_of_another_device_or_backbone_are_refused(field, other):
    with pytest.raises(ValueError, match=f"^{field}: the files mix"):
        plot_context.speedups([_result(2048, {"xmod-a4k8": (0.98, 1.51)}), _result(8192, {"xmod-a4k8": (1.66, 2.0)}, **other)])
    with pytest.raises(ValueError, match="^results: no throughput.py result files given"):
        plot_context.speedups([])
