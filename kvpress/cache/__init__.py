from .cache import KVPressCache
from .layer import KVPressLayer

__all__ = ["KVPressCache", "KVPressLayer"]
