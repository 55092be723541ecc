"""``xmod export-hf`` / ``xmod import-hf`` on real checkpoints: tiny models of every family trained by the
entry point (torchrun, CPU/gloo) and saved at TP1/PP1, TP2 or PP2 (tests/hf_io_helpers.py), exported on
one process; logit parity with the megatron model in eval mode, the bit-exact round trip, resuming
from an imported checkpoint, and loading + generating where megatron is not importable."""
import json
import subprocess
import sys

import hf_io_helpers
import pytest
import torch
from entry_point_helpers import common_flags, torchrun, train_losses
from hf_io_helpers import FAMILIES, LAYOUT_NAMES, REPO, megatron_logits, run_hidden

from megatron_xmod.hf.export import args_from_json, args_to_json, export_checkpoint
from megatron_xmod.hf.importer import import_folder, read_hf_weights

hf_checkpoints = hf_io_helpers.hf_checkpoints  # the session's shared checkpoints


@pytest.fixture(scope="module")
def exported(hf_checkpoints, tmp_path_factory):
    """``exported(family)``: (checkpoint folder, exported HF folder), exported once."""
    root = tmp_path_factory.mktemp("hf_export")
    done = {}

    def get(family):
        if family not in done:
            checkpoint = hf_checkpoints(family)
            # a small shard size makes even the tiny models exercise the sharded index
            export_checkpoint(checkpoint, root / family, dtype="fp32", max_shard_size="200KB", progress=False)
            done[family] = (checkpoint, root / family)
        return done[family]

    return get


def _tokens(batch=2, length=64, seed=0):
    return torch.randint(0, 255, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


# --- parity on every family, every layout -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_exported_logits_match_megatron_eval_mode(exported, family):
    checkpoint, folder = exported(family)
    tokens = _tokens()
    expected = megatron_logits(checkpoint, tokens)
    with torch.no_grad():
        got = _hf_model(folder)(tokens, use_cache=False).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4,
                               msg=lambda m: f"{family} saved at {LAYOUT_NAMES[family]}: {m}")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "megatron_xmod" and config["auto_map"]["AutoModelForCausalLM"]
    info = json.loads((folder / "megatron_xmod_export.json").read_text())
    assert info["iteration"] == 2
    if family in ("xmod", "mod"):  # the routing is really exercised: some but not all tokens selected
        assert config["routing_family"] == family and "sparse" in config["layer_kinds"]


@pytest.mark.slow
def test_dtopp_exports_the_controllers_final_threshold(exported):
    checkpoint, folder = exported("dtopp")
    from megatron_xmod.hf.checkpoint_io import load_checkpoint

    state = load_checkpoint(checkpoint).state_dict
    weights = read_hf_weights(folder)
    thresholds = {k: v for k, v in weights.items() if k.endswith("dtopp_threshold")}
    assert len(thresholds) == 2  # one controller per layer's router
    p0 = args_from_json(json.loads((folder / "megatron_xmod_export.json").read_text())["megatron_args"]).dtopp_p0
    for key, value in thresholds.items():
        layer = key.split(".")[2]
        assert value.dtype == torch.float32
        assert torch.equal(value, state[f"decoder.layers.{layer}.mlp.router.dtopp_threshold"])
        assert float(value) != pytest.approx(p0 if p0 is not None else 0.25, abs=1e-6)  # the controller moved it


@pytest.mark.slow
def test_sharded_weights_have_an_index(exported):
    _, folder = exported("xmod")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((folder / f).is_file() for f in files)
    weights = read_hf_weights(folder)
    assert set(weights) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in weights.values())


# --- round trip and continued pre-training ----------------------------------------------------------------

@pytest.mark.slow
def test_export_import_export_is_bit_identical(exported, tmp_path):
    checkpoint, folder = exported("mod")  # saved at PP2
    import_folder(folder, tmp_path / "imported", pipeline_model_parallel_size=2)
    again = tmp_path / "again"
    export_checkpoint(tmp_path / "imported", again, dtype="fp32", max_shard_size="200KB", progress=False)
    first, second = read_hf_weights(folder), read_hf_weights(again)
    assert first.keys() == second.keys()
    for key in first:
        assert first[key].dtype == second[key].dtype and torch.equal(first[key], second[key]), key
    strip = ("_name_or_path", "transformers_version")
    c1, c2 = (json.loads((f / "config.json").read_text()) for f in (folder, again))
    assert {k: v for k, v in c1.items() if k not in strip} == {k: v for k, v in c2.items() if k not in strip}
    # and the megatron tensors themselves
    from megatron_xmod.hf.checkpoint_io import load_checkpoint

    original, imported = load_checkpoint(checkpoint).state_dict, load_checkpoint(tmp_path / "imported").state_dict
    assert original.keys() == imported.keys()
    assert all(torch.equal(original[k], imported[k]) for k in original)


@pytest.mark.slow
def test_imported_checkpoint_resumes_with_the_entry_point_at_tp2(exported, hf_checkpoints, tmp_path):
    """import-hf at TP2; the entry point --loads it at TP2 and trains. Its first step's loss equals the
    loss of the same step from the original checkpoint's weights (fresh optimizer, iteration 0)."""
    checkpoint, folder = exported("xmod")  # saved at TP2
    import_folder(folder, tmp_path / "imported", tensor_model_parallel_size=2)
    nproc, layout, model = FAMILIES["xmod"]
    common = ["--lr-warmup-iters", "1", "--eval-iters", "0", *layout, *model]
    resumed = torchrun(nproc, ["-m", "megatron_xmod.pretrain"],
                       common_flags(hf_checkpoints.data, 2, "--load", str(tmp_path / "imported"), *common))
    reference = torchrun(nproc, ["-m", "megatron_xmod.pretrain"],
                         common_flags(hf_checkpoints.data, 2, "--load", str(checkpoint), "--finetune",
                                      "--no-load-optim", "--no-load-rng", *common))
    assert "loading release" in resumed.stdout
    got, want = train_losses(resumed.stdout), train_losses(reference.stdout)
    assert sorted(got) == [1, 2] and got == want
    assert got[1] < 5.4  # trained weights, not a fresh model (ln 256 = 5.55)


# --- the exported folder without megatron -----------------------------------------------------------------

@pytest.mark.slow
def test_exported_folder_loads_and_generates_without_megatron(exported, tmp_path):
    checkpoint, folder = exported("xmod")
    out = run_hidden(folder, "The quick brown fox", cwd=tmp_path)
    assert out["loaded"] == [] and not out["class"].startswith("megatron_xmod")
    assert out["prompt_ids"] == list(b"The quick brown fox")  # the byte tokenizer of the run
    assert out["cached"] == out["plain"]  # sparse KV cache == recomputation
    assert len(out["cached"]) == len(out["prompt_ids"]) + 24
    expected = megatron_logits(checkpoint, torch.tensor([out["prompt_ids"]]))
    assert out["logits_sum"] == pytest.approx(float(expected.double().sum()), rel=1e-5, abs=1e-2)


# --- errors and pieces ---------------------------------------------------------------------------------------

def test_args_json_round_trip_keeps_dtypes_and_enums():
    import argparse

    from megatron.core.enums import ModelType

    args = argparse.Namespace(params_dtype=torch.bfloat16, model_type=ModelType.encoder_or_decoder, num_layers=4,
                              layout="D*4", func=print)
    back = args_from_json(json.loads(json.dumps(args_to_json(args))))
    assert back.params_dtype is torch.bfloat16 and back.model_type is ModelType.encoder_or_decoder
    assert back.num_layers == 4 and not hasattr(back, "func")


@pytest.mark.slow  # three CLI start-ups, ~17 s
def test_cli_errors_name_the_field(tmp_path):
    def xmod(*argv):
        return subprocess.run([sys.executable, "-m", "megatron_xmod.cli", *argv], capture_output=True, text=True,
                              cwd=REPO, timeout=300)

    result = xmod("export-hf", "--load", str(tmp_path / "missing"), "--output", str(tmp_path / "out"))
    assert result.returncode == 2 and "load:" in result.stderr
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7")
    (tmp_path / "ckpt" / "iter_0000003").mkdir()
    result = xmod("export-hf", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), "--iteration", "5")
    assert result.returncode == 2 and "iteration: " in result.stderr and "iter_0000003" in result.stderr
    result = xmod("import-hf", str(tmp_path), "--save", str(tmp_path / "s"))
    assert result.returncode == 2 and "folder:" in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "s").exists()


# --- tokenizers ---------------------------------------------------------------------------------------------

SAMPLE = "Now is the winter of our discontent\nMade glorious summer by this sun of York;  1592 ☃ naïve\n"


def _saved_and_loaded(args, tmp_path):
    from transformers import AutoTokenizer

    from megatron_xmod.hf.tokenizer_export import export_tokenizer

    export_tokenizer(args, tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("vocab_size", [256, 257])
def test_byte_tokenizer_is_megatrons_null_tokenizer(tmp_path, vocab_size):
    import argparse

    tok = _saved_and_loaded(argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=vocab_size), tmp_path)
    assert tok(SAMPLE)["input_ids"] == list(SAMPLE.encode())
    assert tok.eos_token_id == vocab_size - 1 and tok.decode(list(SAMPLE.encode())) == SAMPLE


def test_sentencepiece_tokenizer_exports_with_the_same_ids(tmp_path):
    import argparse

    import sentencepiece as spm
    from helpers import english_bytes

    from megatron_xmod.data.tokenizers import train_sentencepiece

    text = tmp_path / "text.txt"
    text.write_bytes(bytes(english_bytes().tolist()))
    model = train_sentencepiece([text], vocab_size=400, out_prefix=tmp_path / "spm")
    tok = _saved_and_loaded(argparse.Namespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(model)),
                            tmp_path / "hf")
    sp = spm.SentencePieceProcessor(model_file=str(model))
    held_out = json.__doc__ + subprocess.__doc__ + SAMPLE  # text the model was not trained on
    assert tok(held_out, add_special_tokens=False)["input_ids"] == sp.encode(held_out)
    assert tok.decode(sp.encode(held_out)) == held_out and tok.eos_token_id == sp.eos_id()


def test_gpt2_tokenizer_folder_exports(tmp_path):
    import argparse

    from megatron_xmod.data.tokenizers import GPT2Tokenizer, TokenizerFileError, write_gpt2_hf_files

    try:
        folder = write_gpt2_hf_files(tmp_path / "gpt2")
    except TokenizerFileError as error:
        pytest.skip(f"GPT-2 files not installed: {error}")
    tok = _saved_and_loaded(argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder)),
                            tmp_path / "hf")
    assert tok(SAMPLE)["input_ids"] == GPT2Tokenizer().encode(SAMPLE) and tok.eos_token_id == 50256


def test_unsupported_tokenizer_names_the_field(tmp_path):
    import argparse

    from megatron_xmod.hf.tokenizer_export import build_tokenizer

    with pytest.raises(ValueError, match="^tokenizer_type: 'TikTokenizer'"):
        build_tokenizer(argparse.Namespace(tokenizer_type="TikTokenizer"))
    with pytest.raises(ValueError, match="^tokenizer_model: .* does not exist"):
        build_tokenizer(argparse.Namespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "x")))
