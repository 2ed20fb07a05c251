"""Corpora and the seekable sampler."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe_ckpt.data import (
    BatchLayout,
    SeekableSampler,
    stdlib_corpus,
    textfile_corpus,
)
from lightning_moe_ckpt.data.corpus import _python_sources
from lightning_moe_ckpt.errors import ConfigError

FRESH_PROCESS = """
import hashlib, sys
from lightning_moe_ckpt.data import BatchLayout, SeekableSampler, stdlib_corpus
corpus = stdlib_corpus()
sampler = SeekableSampler(corpus.train, 64, BatchLayout(16, 2, 2), seed=1234)
inputs, targets = sampler.microbatch(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
print(hashlib.sha256(inputs.numpy().tobytes() + targets.numpy().tobytes()).hexdigest())
"""


@pytest.fixture(scope="module")
def corpus():  # type: ignore[no-untyped-def]
    return stdlib_corpus()


def test_stdlib_corpus_is_real_deterministic_text(corpus) -> None:  # type: ignore[no-untyped-def]
    assert corpus.train.dtype == torch.uint8 and corpus.vocab_size == 256
    assert corpus.train.numel() > 1_000_000 and corpus.val.numel() > 10_000
    assert b"def " in bytes(corpus.train[:200_000].tolist())
    again = stdlib_corpus()
    assert again.fingerprint == corpus.fingerprint
    assert torch.equal(again.val, corpus.val)


def test_stdlib_sources_are_every_py_file_outside_excluded_directories(tmp_path: Path) -> None:
    """The pruned walk keeps exactly what filtering every ``*.py`` file under the root by
    its path's parts keeps, in sorted relative-path order (so the corpus's bytes, split
    and fingerprint do not depend on how the files are found)."""
    for relative in ("a.py", "b.txt", "pkg/z.py", "pkg/__init__.py", "pkg/sub/deep.py",
                     "site-packages/lib/x.py", "pkg/site-packages/y.py", "__pycache__/c.py",
                     "pkg/__pycache__/m.py", "A/upper.py", "pkg.py/inner.py", "pkg2/n.PY"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("# x\n")
    filtered = sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*.py")
                      if path.is_file() and not {"site-packages", "__pycache__"}.intersection(
                          path.relative_to(tmp_path).parts))
    assert _python_sources(tmp_path) == filtered
    assert filtered == ["A/upper.py", "a.py", "pkg.py/inner.py", "pkg/__init__.py",
                        "pkg/sub/deep.py", "pkg/z.py"]


def test_sampler_identical_in_fresh_process(corpus) -> None:  # type: ignore[no-untyped-def]
    sampler = SeekableSampler(corpus.train, 64, BatchLayout(16, 2, 2), seed=1234)
    for iteration, shard, index in [(0, 0, 0), (17, 1, 1), (123456, 0, 1)]:
        inputs, targets = sampler.microbatch(iteration, shard, index)
        here = hashlib.sha256(inputs.numpy().tobytes() + targets.numpy().tobytes()).hexdigest()
        there = subprocess.run(
            [sys.executable, "-c", FRESH_PROCESS, str(iteration), str(shard), str(index)],
            capture_output=True, text=True, check=True).stdout.strip()
        assert here == there


def test_targets_are_inputs_shifted() -> None:
    tokens = torch.arange(1000, dtype=torch.int64) % 256
    sampler = SeekableSampler(tokens.to(torch.uint8), 10, BatchLayout(4), seed=0)
    inputs, targets = sampler.microbatch(3, 0, 0)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal((inputs + 1) % 256, targets)


@settings(max_examples=30, deadline=None)
@given(microbatches=st.sampled_from([1, 2, 4]), shards=st.sampled_from([1, 2, 4]),
       iteration=st.integers(0, 10**6), seed=st.integers(0, 2**31))
def test_every_layout_covers_the_same_global_batch(microbatches: int, shards: int,
                                                   iteration: int, seed: int) -> None:
    tokens = (torch.arange(5000) % 251).to(torch.uint8)
    reference = SeekableSampler(tokens, 8, BatchLayout(16), seed)
    sharded = SeekableSampler(tokens, 8, BatchLayout(16, microbatches, shards), seed)
    pieces = [sharded.microbatch(iteration, s, m)[0]
              for m in range(microbatches) for s in range(shards)]
    assert torch.equal(torch.cat(pieces), reference.microbatch(iteration, 0, 0)[0])
    different = SeekableSampler(tokens, 8, BatchLayout(16), seed + 1)
    assert not torch.equal(different.offsets(iteration), reference.offsets(iteration))


def test_textfile_corpus_and_errors(tmp_path: Path) -> None:
    text = tmp_path / "poem.txt"
    text.write_text("héllo wörld\n" * 500, encoding="utf-8")
    corpus = textfile_corpus(str(text), val_fraction=0.1)
    assert corpus.train.numel() + corpus.val.numel() == len(text.read_bytes())
    with pytest.raises(ConfigError, match=r"data\.path=None"):
        textfile_corpus(None)
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match=f"data.path='{missing}' is not an existing file"):
        textfile_corpus(str(missing))
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        textfile_corpus(str(binary))


def test_layout_errors_name_keys() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.global_batch=10 must be divisible by "
                                          r"parallel\.microbatches=4"):
        BatchLayout(10, 4)
    with pytest.raises(ConfigError, match=r"parallel\.microbatches=0"):
        BatchLayout(8, 0)
