"""`python -m k3jax convert / generate` on a tiny checkpoint written by the tests."""

import shutil

import numpy as np
import pytest

import k3jax
from k3jax import checkpoint, cli, converted, testing


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf")
  testing.write_tiny_hf(path, k3jax.preset("tiny"), seed=0, fmt="kimi_k3")
  return path


def _generated(capsys) -> list[int]:
  return [int(t) for t in capsys.readouterr().out.split()]


# The tiny checkpoint's widths are below the Pallas kernels' (D % 128 for the short conv): XLA on every machine.
@pytest.mark.slow
def test_convert_then_generate_matches_generate_from_hf(tiny_k3, tmp_path, capsys):
  assert cli.main(["generate", "--hf", str(tiny_k3), "--tokens", "3,1,4,1,5", "--max-new-tokens", "4",
                   "--impl", "xla"]) == 0
  from_hf = _generated(capsys)
  assert cli.main(["convert", "--hf", str(tiny_k3), "--out", str(tmp_path / "conv")]) == 0
  capsys.readouterr()
  assert cli.main(["generate", "--converted", str(tmp_path / "conv"), "--tokens", "3 1 4 1 5",
                   "--max-new-tokens", "4", "--impl", "xla"]) == 0
  from_converted = _generated(capsys)
  assert len(from_hf) == 4 and from_hf == from_converted

  # Greedy decoding is consistent with one prefill over the prompt and the generated tokens.
  cfg, model = converted.load_converted(tmp_path / "conv", impl="xla")
  seq = [3, 1, 4, 1, 5] + from_hf
  logits, _ = k3jax.prefill(model, np.asarray(seq, np.int32), np.asarray([0, len(seq)], np.int32),
                            k3jax.init_cache(cfg, 1, len(seq)))
  assert np.argmax(np.asarray(logits, np.float32)[4:8], axis=-1).tolist() == from_hf


def test_generate_names_the_backend_of_a_kernel_size_limit(tiny_k3, capsys, monkeypatch):
  """A kernel's NotImplementedError (a width it does not support) is one line naming ``--impl`` and the way out;
  the model is loaded with the asked backend."""
  seen = []

  def limited(cfg, model, prompt, n):
    seen.append((cfg.impl, model.cfg.impl))
    raise NotImplementedError("the short conv kernel needs D % 128 == 0, got D=64")

  monkeypatch.setattr(cli, "generate_tokens", limited)
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--hf", str(tiny_k3), "--tokens", "1", "--impl", "pallas"])
  err = capsys.readouterr().err.splitlines()[-1]  # after load_hf's progress bar
  assert e.value.code == 2 and seen == [("pallas", "pallas")]
  assert err.startswith("k3jax: error: --impl pallas: the short conv kernel needs D % 128 == 0") and "--impl xla" in err
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--hf", str(tiny_k3), "--tokens", "1", "--impl", "triton"])
  assert e.value.code == 2 and "invalid choice: 'triton'" in capsys.readouterr().err


def test_generate_converted_rejects_other_directories(tiny_k3, tmp_path, capsys):
  # An HF checkpoint directory is not a converted one; a missing directory is named. One line, status 2.
  for path, why in ((tiny_k3, "is not a k3jax converted checkpoint"), (tmp_path / "missing", "no such directory")):
    with pytest.raises(SystemExit) as e:
      cli.main(["generate", "--converted", str(path), "--tokens", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(path) in err and why in err and len(err.splitlines()) == 1


def test_generate_rejects_bad_prompts(tiny_k3):
  cfg, model = checkpoint.load_hf(tiny_k3, progress=False)
  with pytest.raises(ValueError, match="prompt must hold at least one token"):
    cli.generate_tokens(cfg, model, [], 2)
  with pytest.raises(ValueError, match=f"prompt tokens must be in \\[0, {cfg.vocab_size}\\)"):
    cli.generate_tokens(cfg, model, [cfg.vocab_size], 2)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    cli.generate_tokens(cfg, model, [1], 0)


def _user_error(capsys, argv: list[str]) -> str:
  """``cli.main(argv)``'s one stderr line: ``k3jax: error: ...``, exit status 2, no traceback."""
  with pytest.raises(SystemExit) as exit_:
    cli.main(argv)
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and err.startswith("k3jax: error: ") and err.count("\n") == 1, err
  assert "Traceback" not in err
  return err


def test_help_is_plain_text_with_defaults(capsys):
  for argv in (["--help"], ["convert", "--help"], ["generate", "--help"]):
    with pytest.raises(SystemExit) as exit_:
      cli.main(argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "`" not in out and "usage: python -m k3jax" in out, out
  assert "--max-new-tokens N    tokens to generate (default: 16)" in out


@pytest.fixture
def no_weights(monkeypatch):
  """Loading a checkpoint fails the test: a user mistake must be reported before any weight is read."""
  def refuse(*args, **kwargs):
    raise AssertionError("the checkpoint was loaded before the arguments were checked")
  monkeypatch.setattr(checkpoint, "load_hf", refuse)
  monkeypatch.setattr(cli, "load_converted", refuse)


@pytest.mark.parametrize("argv, match", [
    (["generate", "--hf", "{missing}", "--tokens", "1"], "--hf {missing}: no such directory"),
    (["generate", "--hf", "{file}", "--tokens", "1"], "--hf {file}: not a directory"),
    (["generate", "--hf", "{empty}", "--tokens", "1"], "--hf {empty} has no config.json"),
    (["convert", "--hf", "{empty}", "--out", "{missing}"], "--hf {empty} has no config.json"),
    (["convert", "--hf", "{hf}", "--out", "{file}"], "--out {file}: exists and is not a directory"),
    (["generate", "--converted", "{missing}", "--tokens", "1"], "--converted {missing}: no such directory"),
    (["generate", "--hf", "{hf}", "--tokens", ""], "argument --tokens: no token ids given"),
    (["generate", "--hf", "{hf}", "--tokens", " , "], "argument --tokens: no token ids given"),
    (["generate", "--hf", "{hf}", "--tokens", "1,x"], "integers separated by commas or spaces, got 'x'"),
    (["generate", "--hf", "{hf}", "--tokens", "1,{vocab}"], "token ids must be in [0, {vocab}) (vocab_size of "),
    (["generate", "--hf", "{hf}", "--tokens=-1"], "token ids must be in [0, {vocab}) "),
    (["generate", "--hf", "{hf}", "--tokens", "1", "--max-new-tokens", "0"], "must be an integer >= 1, got 0"),
    (["generate", "--hf", "{hf}", "--tokens", "1", "--max-new-tokens", "two"], "must be an integer >= 1, got 'two'"),
    (["generate", "--hf", "{hf}"], "the following arguments are required: --tokens (see 'python -m k3jax generate"),
    ([], "the following arguments are required: command"),
])
def test_user_mistakes_are_one_line_before_loading(tiny_k3, tmp_path, capsys, no_weights, argv, match):
  (tmp_path / "empty").mkdir()
  (tmp_path / "file").write_text("")
  names = {"hf": tiny_k3, "missing": tmp_path / "missing", "file": tmp_path / "file", "empty": tmp_path / "empty",
           "vocab": k3jax.preset("tiny").vocab_size}
  argv = [a.format(**names) for a in argv]
  assert match.format(**names) in _user_error(capsys, argv)


def test_checkpoint_errors_while_loading_are_one_line(tiny_k3, tmp_path, capsys):
  # A truncated shard is found only while the weights are read; the library's ValueError becomes one line.
  path = tmp_path / "hf"
  shutil.copytree(tiny_k3, path)
  shard = sorted(path.glob("*.safetensors"))[-1]
  shard.write_bytes(shard.read_bytes()[:-100])
  assert f"--hf {path}" in _user_error(capsys, ["generate", "--hf", str(path), "--tokens", "1"])
