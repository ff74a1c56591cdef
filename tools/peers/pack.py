"""Pack a peer kernel's source, with the CUTLASS headers at its submodule pin, into ``.peers/NAME.tar.xz``.

The peers (FlashKDA, FlashMLA) are other projects' CUDA code: they are never committed here. This script turns
local git mirrors of them into one small archive each, in the git-ignored ``.peers/`` folder, which is carried to
the GPU machine and built there (``tools/peers/build_*.sh``). Only what a Hopper build reads is kept: no docs,
no tests, no other architectures' sources, and of CUTLASS only the header folders the peer's build includes.

Usage: ``python3 tools/peers/pack.py NAME --repo MIRROR.git --cutlass CUTLASS_MIRROR.git`` (NAME: flashkda or
flashmla; a mirror is any git directory holding the pinned commits, e.g. a bare clone).
"""

import argparse
import dataclasses
import io
import pathlib
import subprocess
import sys
import tarfile


@dataclasses.dataclass(frozen=True)
class Peer:
  commit: str                 # the peer's commit we build and quote
  drop: tuple[str, ...]       # path prefixes not needed for an sm_90a build
  cutlass_path: str           # where its CUTLASS submodule sits in its tree
  cutlass_dirs: tuple[str, ...]  # the CUTLASS folders its build includes


PEERS = {
    "flashkda": Peer("1ce47ea", ("docs/", "tests/", "benchmarks/", "BENCHMARK_"), "cutlass",
                     ("include", "tools/util/include", "examples/common")),
    "flashmla": Peer("9241ae3", ("docs/", "tests/", "benchmark/", "csrc/sm100/"), "csrc/cutlass",
                     ("include", "tools/util/include")),
}


def _git(repo: pathlib.Path, *args: str) -> bytes:
  return subprocess.run(("git", "--git-dir", str(repo), *args), check=True, capture_output=True).stdout


def _archive(repo: pathlib.Path, commit: str, *paths: str) -> tarfile.TarFile:
  return tarfile.open(fileobj=io.BytesIO(_git(repo, "archive", "--format=tar", commit, *paths)))


def pack(name: str, repo: pathlib.Path, cutlass: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
  peer = PEERS[name]
  # The submodule's pinned commit is recorded in the peer's tree ("160000 commit <sha>\t<path>").
  pin = _git(repo, "ls-tree", peer.commit, peer.cutlass_path).split()[2].decode()
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{name}.tar.xz"
  with tarfile.open(path, "w:xz") as dst:
    src = _archive(repo, peer.commit)
    for m in src.getmembers():
      if m.isfile() and not m.name.startswith(peer.drop):
        dst.addfile(m, src.extractfile(m))
    lib = _archive(cutlass, pin, *peer.cutlass_dirs)
    for m in lib.getmembers():
      if m.isfile():
        data = lib.extractfile(m)
        m.name = f"{peer.cutlass_path}/{m.name}"
        dst.addfile(m, data)
  print(f"{path}: {name} {peer.commit}, CUTLASS {pin[:8]}, {path.stat().st_size / 2**20:.1f} MiB")
  return path


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("name", choices=sorted(PEERS))
  parser.add_argument("--repo", type=pathlib.Path, required=True, help="git dir of the peer's mirror")
  parser.add_argument("--cutlass", type=pathlib.Path, required=True, help="git dir of a CUTLASS mirror")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".peers"))
  args = parser.parse_args(argv)
  pack(args.name, args.repo, args.cutlass, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
