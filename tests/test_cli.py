"""`python -m k3jax convert / generate` on a tiny checkpoint written by the tests."""

import numpy as np
import pytest

import k3jax
from k3jax import checkpoint, cli, testing


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf")
  testing.write_tiny_hf(path, k3jax.preset("tiny"), seed=0, fmt="kimi_k3")
  return path


def _generated(capsys) -> list[int]:
  return [int(t) for t in capsys.readouterr().out.split()]


def test_convert_then_generate_matches_generate_from_hf(tiny_k3, tmp_path, capsys):
  assert cli.main(["generate", "--hf", str(tiny_k3), "--tokens", "3,1,4,1,5", "--max-new-tokens", "4"]) == 0
  from_hf = _generated(capsys)
  assert cli.main(["convert", "--hf", str(tiny_k3), "--out", str(tmp_path / "conv")]) == 0
  capsys.readouterr()
  assert cli.main(["generate", "--converted", str(tmp_path / "conv"), "--tokens", "3 1 4 1 5",
                   "--max-new-tokens", "4"]) == 0
  from_converted = _generated(capsys)
  assert len(from_hf) == 4 and from_hf == from_converted

  # Greedy decoding is consistent with one prefill over the prompt and the generated tokens.
  cfg, model = cli.load_converted(tmp_path / "conv")
  seq = [3, 1, 4, 1, 5] + from_hf
  logits, _ = k3jax.prefill(model, np.asarray(seq, np.int32), np.asarray([0, len(seq)], np.int32),
                            k3jax.init_cache(cfg, 1, len(seq)))
  assert np.argmax(np.asarray(logits, np.float32)[4:8], axis=-1).tolist() == from_hf


def test_converted_params_are_checked(tiny_k3, tmp_path):
  cfg, model = checkpoint.load_hf(tiny_k3, progress=False)
  cli.save_converted(cfg, model, tmp_path)
  from safetensors import numpy as st
  tensors = st.load_file(tmp_path / cli.PARAMS_FILE)
  name = sorted(tensors)[0]
  st.save_file({**tensors, name: tensors[name][..., :1]}, tmp_path / cli.PARAMS_FILE)
  with pytest.raises(ValueError, match=f"{name} must be"):
    cli.load_converted(tmp_path)
  st.save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / cli.PARAMS_FILE)
  with pytest.raises(ValueError, match=f"has no tensor '{name}'"):
    cli.load_converted(tmp_path)
  st.save_file({**tensors, "extra": tensors[name]}, tmp_path / cli.PARAMS_FILE)
  with pytest.raises(ValueError, match="unexpected tensors \\['extra'\\]"):
    cli.load_converted(tmp_path)


def test_generate_rejects_bad_prompts(tiny_k3):
  cfg, model = checkpoint.load_hf(tiny_k3, progress=False)
  with pytest.raises(ValueError, match="prompt must hold at least one token"):
    cli.generate_tokens(cfg, model, [], 2)
  with pytest.raises(ValueError, match=f"prompt tokens must be in \\[0, {cfg.vocab_size}\\)"):
    cli.generate_tokens(cfg, model, [cfg.vocab_size], 2)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    cli.generate_tokens(cfg, model, [1], 0)
  with pytest.raises(SystemExit):
    cli.main(["generate", "--hf", str(tiny_k3), "--tokens", "a,b"])
