"""``tierstore train --nproc N``: the same command as N processes of this host, started by torchrun's launcher.

torch's own launcher (``torch.distributed.run``, what the ``torchrun`` command runs) starts the ranks with
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and a free rendezvous port (``--standalone``), watches them, and ends the
others when one fails; each rank runs ``python -m runtime.cli train`` with the same arguments but ``--nproc``, and
``offload()`` joins the process group from that environment (``runtime.core.ranks``). What it leaves out: what each
rank trains on (``runtime.cli.train`` splits each micro-batch between the ranks).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` with its ``--nproc N`` (or ``--nproc=N``) taken out."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def launch(argv: list[str], nproc: int) -> int:
    """Run ``tierstore`` with ``argv`` (less ``--nproc``) as ``nproc`` ranks of this host; the exit status of the first
    rank that failed, else 0."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    launcher = get_args_parser().parse_args(["--nproc-per-node", str(nproc), "--standalone", "-m", "runtime.cli",
                                             *without_nproc(argv)])
    try:
        run(launcher)
    except ChildFailedError as failed:
        first = failed.get_first_failure()[1]
        return first.exitcode if first.exitcode and first.exitcode > 0 else 1
    except SignalException as signalled:  # SIGTERM / SIGINT to the launcher: it sent it on to every rank, which each
        # abandoned its step, closed its session and removed its swap files (runtime.core.signals)
        log.warning("tierstore train --nproc %d: stopped by signal %d; every rank was sent it and closed its session",
                    nproc, int(signalled.sigval))
        return 128 + int(signalled.sigval)
    return 0
