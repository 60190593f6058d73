"""What changed in transformers across the releases pyproject admits (5.19 on), met in one place by its mechanism,
never by a version number.

- Loading. From 5.25 `from_pretrained` kernelizes a model by default (`use_kernels` unset reads as True): layers are
  swapped for kernels the `kernels` package fetches from the Hugging Face Hub, and without that package every load
  fails. The audit holds models to the references' torch code, offline, and runs no downloaded code (as it never
  passes `trust_remote_code`), so `from_pretrained` here always loads a model without them; earlier releases default
  to False and take the keyword too.
- The cache keyword. A model's forward takes its KV cache as `past_key_values` up to 5.23 and as `cache` from 5.24,
  which still renames the old keyword (with a FutureWarning) until 5.40; its outputs carry the cache under the new
  name only. `cache_argument` reads the name from the model's own forward signature; `passed_cache` finds a cache
  under either name.
- Cropping. `crop(n)` read a positive n as the length to keep until 5.18 deprecated it, and 5.24 refuses it; a
  negative n, the count to drop, works on every release, so `crop_to` always passes that.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

# Newest first: the first a forward declares is the one it takes.
CACHE_KEYWORDS = ("cache", "past_key_values")


def from_pretrained(model_class: Any, path: Any, **kwargs: Any) -> Any:
    """`model_class.from_pretrained(path, **kwargs)` on transformers' own torch code (no hub kernels)."""
    return model_class.from_pretrained(path, use_kernels=False, **kwargs)


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters  # through the decorators' functools.wraps
    return next((name for name in CACHE_KEYWORDS if name in parameters), CACHE_KEYWORDS[-1])


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """`{keyword: cache}` for `model(...)`, under the keyword this model's forward declares."""
    return {_cache_keyword(type(model)): cache}


def passed_cache(kwargs: dict[str, Any], output: Any = None) -> Any:
    """The cache a forward was given (either keyword), else the one its output carries, else None."""
    for name in CACHE_KEYWORDS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    for name in CACHE_KEYWORDS:
        found = getattr(output, name, None)
        if found is not None:
            return found
    return None


def crop_to(cache: Any, length: int) -> None:
    """Keep a transformers cache's first `length` positions (nothing to do where it holds no more)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
