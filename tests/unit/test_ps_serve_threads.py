"""``python -m trainmesh.ps --threads``: the server's torch intra-op threads are set before it serves.

A hand-started server otherwise ran torch's default pool, whose idle workers spin after every op:
on 2 cores that cost 0.75 ms of CPU per 1 MB push and cut the 1 MB push rate 2.6x (docs/parameter_server.md).
"""

from __future__ import annotations

import pytest
import torch

from trainmesh.ps import serve

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("argv", "expected"), [([], 1), (["--threads", "3"], 3), (["--threads", "0"], 2)])
def test_serve_sets_intra_op_threads_before_serving(monkeypatch, argv, expected):
    seen = []

    def stop_before_binding(args):
        seen.append(torch.get_num_threads())
        raise ValueError("stopped by the test before the server binds")

    monkeypatch.setattr(serve, "_secret", stop_before_binding)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # what "--threads 0" must leave as it is
        with pytest.raises(SystemExit, match="stopped by the test"):
            serve.main(argv)
    finally:
        torch.set_num_threads(before)
    assert seen == [expected]


def test_serve_refuses_negative_threads(capsys):
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--threads", "-1"])
    assert "--threads" in capsys.readouterr().err
