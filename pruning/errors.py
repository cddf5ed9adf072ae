"""The errors of the offline pipeline (grouping, pruning, retraining, the artifact)."""

from __future__ import annotations

from sensai.errors import SensaiError


class SettingsMismatch(SensaiError):
    """The output directory holds a decomposition made with other settings."""


class RetrainFailed(SensaiError):
    """One or more subnets could not be retrained; the others are saved."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


class UnsupportedModel(SensaiError, ValueError):
    """The network has a shape decomposition cannot take: one line saying which part and what
    to change (a ValueError too, as the checks that raise it were)."""
