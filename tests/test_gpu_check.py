"""bench/gpu_check.sh: its step caps fit the 9-minute GPU window, and its --cpu mode runs every step
end to end here and leaves each step's results in $OUT."""
import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
STEPS = ["env", "wheels", "build", "tests", "memcheck", "racecheck", "permute", "ops", "host", "generate",
         "throughput"]


def test_step_caps_fit_nine_minutes():
    out = subprocess.run(["bash", SCRIPT, "--plan"], capture_output=True, text=True, check=True).stdout
    caps = dict(line.split() for line in out.strip().splitlines())
    total = int(caps.pop("total"))
    assert list(caps) == STEPS
    assert total == sum(int(v) for v in caps.values()) and total < 9 * 60
    assert int(caps["throughput"]) >= 150  # the step the targets depend on gets the most


def test_the_gpu_machine_view_holds_torch_and_the_carried_wheels_only(tmp_path):
    """--cpu's steps run where only torch (with its requirements) and the carried wheels import, as on the
    GPU machine: what else this environment has (matplotlib, lm-eval, ...) is out of sight."""
    pins = subprocess.run(["bash", SCRIPT, "--pins"], capture_output=True, text=True, check=True).stdout.split()
    assert "megatron-core==0.19.2" in pins and "transformers==5.24.0" in pins
    wrapper = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_machine_env.py"), str(tmp_path), *pins],
                             capture_output=True, text=True, check=True).stdout.strip()
    probe = ("import importlib.util as u, importlib.metadata as m, torch, megatron.core, transformers\n"
             "print(*[u.find_spec(n) is not None for n in ('torch', 'triton', 'numpy', 'megatron', 'transformers', "
             "'pytest', 'matplotlib', 'lm_eval', 'tensorboard', 'scipy')], m.version('megatron-core'))")
    out = subprocess.run([wrapper, "-c", probe], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout.split()
    assert out == ["True"] * 6 + ["False"] * 4 + ["0.19.2"]
    # the same four are importable in this environment: the view is what hides them
    assert all(importlib.util.find_spec(n) for n in ("matplotlib", "lm_eval", "tensorboard", "scipy"))


def test_every_flag_a_step_passes_is_one_its_script_defines():
    """The GPU branch's command lines run nowhere but on the GPU machine: a flag renamed in a script would
    fail its step there, in the GPU window. Every --flag a step passes a bench script is one of its options."""
    import re

    text = open(SCRIPT).read().replace("\\\n", " ")
    calls = [m.groups() for m in re.finditer(r'step \w+ "\$PY" (bench/\w+\.py)([^\n]*)', text)]
    assert len(calls) == 10  # five scripts, GPU and --cpu branches
    for script, args in calls:
        source = open(os.path.join(ROOT, script)).read()
        for flag in re.findall(r"(--[\w-]+)", args):
            assert f'"{flag}"' in source, f"{script} has no option {flag} (gpu_check.sh passes it)"


def test_unknown_option_is_an_error():
    proc = subprocess.run(["bash", SCRIPT, "--gpu"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown option '--gpu'" in proc.stderr


@pytest.mark.slow
def test_cpu_mode_runs_every_step(tmp_path):
    # The shared CI machine may be busy: the steps get 10x their GPU caps here (CAP_SCALE).
    # conftest exports MASTER_ADDR/MASTER_PORT for this session's process group: the steps need their own
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OUT=str(tmp_path), CAP_SCALE="10")
    proc = subprocess.run(["bash", SCRIPT, "--cpu"], capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary[1:]] == [[s, "ok"] for s in STEPS]
    for step in STEPS:
        assert (tmp_path / f"{step}.log").exists(), step
    suite = ET.parse(tmp_path / "tests.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 4 and suite.get("failures") == "0" and suite.get("errors") == "0"
    assert "0 mismatches" in (tmp_path / "memcheck.log").read_text()
    rows = [json.loads(line) for line in (tmp_path / "permute_cpu.jsonl").read_text().splitlines()]
    ops = ("routing.fwd", "gather.fwd", "gather.bwd", "scatter.fwd", "scatter.bwd")
    assert {(r["op"], r["b"]) for r in rows} == {(op, b) for op in ops for b in (1, 2)}
    assert all(r["us"] > 0 and r["of_copy"] > 0 for r in rows)
    ops = json.loads((tmp_path / "ops_cpu.json").read_text())["rows"]
    kernels = {(r["layer"], r["phase"]): r["kernels"] for r in ops}
    assert kernels[("xmod_sparse", "forward")] > kernels[("dense", "forward")] > 0
    throughput = json.loads((tmp_path / "throughput_cpu.json").read_text())["rows"]
    assert [r["model"] for r in throughput] == ["dense", "xmod-a4k8"]
    assert all(r["train_microbatches_run"] == 2 * 2 and r["optimizer_s"] > 0 for r in throughput)
    host = json.loads((tmp_path / "host_overhead_cpu.json").read_text())
    assert [r["layer"] for r in host["layers"]] == ["dense", "xmod_sparse", "mod_sparse"]
    assert [r["model"] for r in host["steps"]] == ["dense", "mod"]
    assert {r["model"] for r in host["step_model"]} == {"dense", "mod", "xmod-a4k8", "xmod-a3k16"}
    assert all(r["error"].startswith("skipped") for r in host["graphs"])  # no GPU here
    assert [r["model"] for r in host["profiled"]] == ["dense", "mod"]
    # the steps ran with the GPU machine's packages: no matplotlib, so no PNG, and a way to draw it here
    assert "no PNG: matplotlib is not installed" in (tmp_path / "generate.log").read_text()
    results = next(tmp_path.glob("generate_cpu_*_quick.json"))
    assert not results.with_suffix(".png").exists()
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "generate.py"), "--plot", str(results)], check=True,
                   capture_output=True)
    assert results.with_suffix(".png").stat().st_size > 0
    meta, generated = (json.loads(results.read_text())[key] for key in ("meta", "rows"))
    assert meta["if_nodes"] in ("torch", "extension", "none")
    assert {(r["model"], r["batch"]) for r in generated} == {(m, b) for m in ("dense", "mod") for b in (1, 2)}
    assert all(r["decode_tok_s"] > 0 and r["kv_cache_bytes"] > 0 for r in generated)
    # the fixed-shape decode ran (eagerly here: no GPU) and decoded the default path's tokens
    assert all(r["fixed_decode_tok_s"] > 0 and r["fixed_same_tokens"] and not r["fixed_cuda_graph"] for r in generated)
