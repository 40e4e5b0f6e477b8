"""Meltano state backend for the statehouse gateway."""

from statehouse_meltano.backend import StatehouseStateStoreManager

__all__ = ["StatehouseStateStoreManager"]
