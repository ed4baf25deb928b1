"""The one error type of the data path: a ValueError whose message names the file and the field."""

from __future__ import annotations


class DataError(ValueError):
    """A data source that cannot be read as asked: missing file, field, split, records or gold answer."""
