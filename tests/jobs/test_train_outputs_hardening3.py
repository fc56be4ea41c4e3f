"""``moonrt train`` hardening 3 (issue 45): another run's metrics file or TensorBoard directory is never taken
over on resume (every metrics record and the event directory carry this run's identity), a user's ``config.yaml``
in ``--out`` is never replaced, one step's memory is estimated before step 1, and a corpus that is not a regular
file is named as what it is. Every refusal is one line on stderr, exit 2, the other file unchanged.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from test_train_hardening import _one_error_line

from moonrt.cli import main
from moonrt.jobs.train.loop import CHECKPOINT

# ---- 4. corpora that are not regular files ---------------------------------------------------------------------


@pytest.mark.parametrize("token_dtype", [None, "uint16"])
def test_a_corpus_that_is_not_a_regular_file_is_named_as_such(tmp_path: Path, capsys, monkeypatch,
                                                               token_dtype) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    monkeypatch.chdir(tmp_path)  # a relative socket name: AF_UNIX paths are short
    sock = socket.socket(socket.AF_UNIX)
    sock.bind("sock")
    cases = [("/dev/null", "not a regular file (character device)"), (str(fifo), "not a regular file (FIFO)"),
             (str(tmp_path / "sock"), "not a regular file (socket)"), (str(tmp_path), "a directory"),
             (str(empty), "an empty file (0 bytes)"), (str(tmp_path / "missing.txt"), "missing")]
    kind = "a UTF-8 text file" if token_dtype is None else f"a {token_dtype} token file"
    extra = [] if token_dtype is None else ["--token-dtype", token_dtype]
    try:
        for corpus, what in cases:
            assert main(["train", "--corpus", corpus, *extra, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
            line = _one_error_line(capsys.readouterr().err)
            assert f"corpus (--corpus) = {corpus!r}: {what}; expected an existing file ({kind})" in line, line
            assert not (tmp_path / "o" / CHECKPOINT).exists()
    finally:
        sock.close()
    assert fifo.exists() and empty.read_bytes() == b""  # nothing opened or written
