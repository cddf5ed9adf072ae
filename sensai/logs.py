"""How sensai's processes log: one format for the command line and the processes it spawns
(gateway and device processes start with no logging set up of their own)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=FORMAT,
                        datefmt="%H:%M:%S")
    # One line per HTTP request from our own clients drowns what the commands say.
    logging.getLogger("httpx").setLevel(logging.WARNING)
