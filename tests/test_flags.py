"""The entry point's flag expansion: presets become megatron's own flags, read by one scanner."""
import pytest

from megatron_xmod.training.flags import expand_arguments, scan_argv
from megatron_xmod.xmod.layout import LayoutError


def _value(argv, flag):
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def test_moe_name_in_xmod_model_is_a_moe_preset():
    argv = expand_arguments(["--xmod-backbone", "556m", "--xmod-model", "moe-8x64"])
    assert _value(argv, "--moe-preset") == "moe-8x64"
    assert _value(argv, "--num-experts") == "64" and _value(argv, "--moe-ffn-hidden-size") == "384"
    assert _value(argv, "--xmod-layout") == "D*28" and _value(argv, "--num-layers") == "28"
    with pytest.raises(LayoutError, match="xmod_model"):
        expand_arguments(["--xmod-backbone", "556m", "--xmod-model", "moe-8x64", "--moe-preset", "moe-8x128"])


def test_family_comes_from_the_layout_and_explicit_flags_win():
    argv = expand_arguments(["--xmod-backbone", "165m", "--xmod-model", "mod", "--hidden-size", "256"])
    assert _value(argv, "--xmod-routing-family") == "mod" and _value(argv, "--num-layers") == "49"
    assert scan_argv(argv).xmod_routing_family == "mod"
    assert argv.index("--hidden-size") < len(argv) - 1 - argv[::-1].index("--hidden-size")  # the user's comes last
    assert _value(argv, "--hidden-size") == "256"


def test_backbone_file_and_cpu_flags_expand(tmp_path):
    import json

    from megatron_xmod.demo import DEMO_BACKBONE
    from megatron_xmod.presets import backbone_flags, backbone_to_dict
    from megatron_xmod.training.flags import CPU_FLAGS
    from megatron_xmod.xmod.layout import parse_layout

    path = tmp_path / "demo.json"
    path.write_text(json.dumps(backbone_to_dict(DEMO_BACKBONE)))
    argv = expand_arguments(["--xmod-backbone", str(path), "--xmod-model", "mod-k4", "--xmod-cpu"])
    text = " ".join(argv)
    assert " ".join(backbone_flags(DEMO_BACKBONE)) in text and " ".join(CPU_FLAGS) in text
    layout = parse_layout(argv[argv.index("--xmod-layout") + 1], "mod")
    assert layout.activated_depth == DEMO_BACKBONE.num_layers  # named models derive their layout for the file's depth
    assert argv[argv.index("--num-layers") + 1] == str(layout.num_layers)


def test_cpu_flags_turn_megatron_compiled_fusions_off_unless_kept():
    from megatron_xmod.training.flags import CPU_COMPILED_FUSIONS

    base = ["--num-layers", "2", "--xmod-cpu"]
    argv = expand_arguments(base)
    assert all(flag in argv for flag in CPU_COMPILED_FUSIONS)
    kept = expand_arguments(base + ["--xmod-cpu-fusions"])
    assert not any(flag in kept for flag in CPU_COMPILED_FUSIONS)
    once = expand_arguments(base + ["--no-bias-swiglu-fusion"])
    assert once.count("--no-bias-swiglu-fusion") == 1
