"""Build :class:`RealKvSource` lists for the common KV pool layouts.

Every builder takes the engine's own arrays (NumPy, CuPy, PyTorch... any DLPack object, any dtype,
bfloat16 and float8 included) and returns zero-copy sources. Each token's bytes must be a multiple
of 16; ``read_bytes`` (ALL mode) defaults to every byte of the token, ``layers`` picks a subset of
the per-layer buffers (hashing fewer layers is cheaper and still catches slot-level corruption).

=========================  =====================================================  ===============
builder                    buffer shape (per layer)                               slot ``s`` reads
=========================  =====================================================  ===============
:func:`per_layer`          ``[slots, heads, head_dim]`` (K and V lists)           row ``s``
:func:`paged`              ``[pages, page_size, heads, head_dim]`` (K and V), or  page ``s // page_size``
                           ``[pages, heads, page_size, head_dim]`` with
                           ``head_major=True`` (a source a head)
:func:`interleaved`        ``[slots, 2, heads, head_dim]``: K then V in one row   row ``s`` (K and V apart)
:func:`mla`                ``[slots, 1, latent]`` or                              row ``s``, or
                           ``[pages, page_size, 1, latent]`` (MLA latent rows)    ``s // page_size``
=========================  =====================================================  ===============
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from . import _layout as L
from . import validate as check
from ._dlpack import native_view
from .sources import RealKvSource, byte_rows

__all__ = ["from_buffer", "per_layer", "paged", "interleaved", "mla"]


def _pick(buffers: Sequence[Any], layers: Optional[Iterable[int]], name: str) -> list[tuple[str, Any]]:
    """The picked layers' buffers, each with its name in messages (``k_buffers[3]``)."""
    if not isinstance(buffers, (list, tuple)):
        raise TypeError(f"{check.PREFIX}{name} must be a list or tuple of arrays (one per layer), "
                        f"got {type(buffers).__name__}")
    buffers = list(buffers)
    if layers is None:
        return [(f"{name}[{layer}]", buffer) for layer, buffer in enumerate(buffers)]
    if not isinstance(layers, (list, tuple, range)):
        raise TypeError(f"{check.PREFIX}layers must be a list, tuple or range of layer indices, "
                        f"got {type(layers).__name__} {layers!r}")
    picked = []
    for index, layer in enumerate(layers):
        layer = check.integer(f"layers[{index}]", layer)
        if not -len(buffers) <= layer < len(buffers):
            raise ValueError(f"{check.PREFIX}layers must index the {len(buffers)} buffers of {name}, in "
                             f"[-{len(buffers)}, {len(buffers)}), got {layer}")
        picked.append((f"{name}[{layer % len(buffers)}]", buffers[layer]))
    return picked


def from_buffer(buffer: Any, *, page_size: int = 1, read_bytes: Optional[int] = None,
                name: str = "buffer") -> RealKvSource:
    """One source over ``buffer`` whose dim 0 indexes pages of ``page_size`` tokens; every byte of a
    row belongs to its ``page_size`` tokens, evenly. ``name`` names the buffer in messages."""
    view = native_view(buffer, name)
    if view.ndim < 2:
        raise ValueError(f"{check.PREFIX}{name} must be at least 2-D, got shape {check.shape_text(view)}")
    page_size = check.positive("page_size", page_size)
    row = check.row_bytes(view)
    if row % page_size:
        raise ValueError(f"{check.PREFIX}{name} rows ({row} bytes) must split evenly into page_size={page_size} "
                         f"tokens, got shape {check.shape_text(view)}")
    per_token = row // page_size
    return _source(name, view, page_size, per_token, read_bytes)


def _given_page_size(page_size: Optional[int]) -> Optional[int]:
    """A builder's ``page_size``, checked once before its buffers (None: taken from each shape)."""
    return None if page_size is None else check.positive("page_size", page_size)


def _source(name: str, view: Any, page_size: int, per_token: int, read_bytes: Optional[int]) -> RealKvSource:
    """A source over ``view``, its rules checked under the names the builder's caller knows."""
    check.positive_multiple(f"{name} bytes per token", per_token, L.SOURCE_ALIGN_BYTES)
    read_bytes = per_token if read_bytes is None else check.source_read_bytes("read_bytes", read_bytes, per_token)
    check.source_rows(name, view, page_size * per_token)
    return RealKvSource(tensor=view, page_size=page_size, num_bytes_per_token=per_token, read_bytes=read_bytes)


def _k_then_v(k_buffers: Sequence[Any], v_buffers: Sequence[Any], layers: Optional[Iterable[int]]) -> list:
    """The picked layers' named buffers in source order: each layer's K, then its V (when V is given)."""
    ks = _pick(k_buffers, layers, "k_buffers")
    if isinstance(v_buffers, (list, tuple)) and not v_buffers:
        vs = []
    else:
        # the whole lists, before ``layers`` picks from them: a layer index (a negative one above
        # all) names another layer in lists of other lengths
        if isinstance(v_buffers, (list, tuple)) and len(v_buffers) != len(k_buffers):
            raise ValueError(f"{check.PREFIX}v_buffers must have one buffer per K buffer, got {len(v_buffers)} "
                             f"for {len(k_buffers)}")
        vs = _pick(v_buffers, layers, "v_buffers")
    return [named for index, k in enumerate(ks) for named in ((k, vs[index]) if vs else (k,))]


def per_layer(k_buffers: Sequence[Any], v_buffers: Sequence[Any] = (), *, layers: Optional[Iterable[int]] = None,
              read_bytes: Optional[int] = None) -> tuple[RealKvSource, ...]:
    """K and V buffers ``[slots, heads, head_dim]`` (or ``[slots, bytes]``) per layer, one token a
    row: K of each picked layer, then its V. Not 4-D: ``[pages, page_size, heads, head_dim]`` taken
    a page a slot would hash the wrong bytes of every slot."""
    out = []
    for name, buffer in _k_then_v(k_buffers, v_buffers, layers):
        view = native_view(buffer, name)
        if view.ndim > 3:
            raise ValueError(f"{check.PREFIX}{name} must be [slots, heads, head_dim] (one token a row), got shape "
                             f"{check.shape_text(view)} (a paged [pages, page_size, heads, head_dim] is "
                             f"kc.layouts.paged, [slots, 2, heads, head_dim] kc.layouts.interleaved; other "
                             f"shapes, kc.layouts.from_buffer with page_size=)")
        out.append(from_buffer(view, page_size=1, read_bytes=read_bytes, name=name))
    return tuple(out)


def paged(k_buffers: Sequence[Any], v_buffers: Sequence[Any] = (), *, layers: Optional[Iterable[int]] = None,
          page_size: Optional[int] = None, head_major: bool = False,
          read_bytes: Optional[int] = None) -> tuple[RealKvSource, ...]:
    """Paged K and V buffers per layer: ``[pages, page_size, heads, head_dim]`` (token-major, one
    source a buffer), or with ``head_major`` ``[pages, heads, page_size, head_dim]`` (a page holds
    each head's tokens together, as an "HND" cache does), one source a head: each layer's K heads,
    then its V heads; ``read_bytes`` and PARTIAL mode's 16 bytes then count in each head's bytes.
    The shape cannot tell the two apart: given ``page_size``, the tokens a page holds are checked
    against it (which tells them apart unless the heads are as many as the page's tokens). Only 4-D
    buffers: a 3-D one may as well be one token a row (``per_layer``), and taking its heads for the
    page size would hash the wrong bytes of every slot."""
    head_major = check.boolean("head_major", head_major)
    page_size = _given_page_size(page_size)
    tokens_dim, layout = (2, "[pages, heads, page_size, head_dim]") if head_major else \
        (1, "[pages, page_size, heads, head_dim]")
    out = []
    for name, buffer in _k_then_v(k_buffers, v_buffers, layers):
        view = native_view(buffer, name)
        if view.ndim != 4:
            raise ValueError(f"{check.PREFIX}{name} must be 4-D {layout}, got shape "
                             f"{check.shape_text(view)} (one token a row, [slots, heads, head_dim], is "
                             f"kc.layouts.per_layer; other shapes, kc.layouts.from_buffer with page_size=)")
        tokens = int(view.shape[tokens_dim])
        if tokens == 0:  # the page size taken from the shape: name the buffer, not page_size
            raise ValueError(f"{check.PREFIX}{name} must hold at least one token a page, shape[{tokens_dim}] of "
                             f"{layout}, got shape {check.shape_text(view)}")
        if page_size is not None and page_size != tokens:
            other_dim, other = (1, "head_major=False takes [pages, page_size, heads, head_dim]") if head_major \
                else (2, "head_major=True takes [pages, heads, page_size, head_dim]")
            other = f" ({other})" if int(view.shape[other_dim]) == page_size else ""
            raise ValueError(f"{check.PREFIX}page_size must be the tokens a page of {name} holds, shape[{tokens_dim}] "
                             f"of {layout}: got {page_size} for shape {check.shape_text(view)}{other}")
        if not head_major:
            out.append(from_buffer(view, page_size=tokens, read_bytes=read_bytes, name=name))
            continue
        if int(view.shape[1]) == 0:  # no source at all: its slots' bytes would go unhashed, unsaid
            raise ValueError(f"{check.PREFIX}{name} must have at least one head, shape[1] of {layout}, got shape "
                             f"{check.shape_text(view)}")
        # a head's tokens of one page are one row of page_size tokens: a view of them a head
        for head in range(int(view.shape[1])):
            out.append(from_buffer(view[:, head:head + 1].transpose(0, 2, 1, 3), page_size=tokens,
                                   read_bytes=read_bytes, name=f"{name} head {head}"))
    return tuple(out)


def interleaved(buffers: Sequence[Any], *, layers: Optional[Iterable[int]] = None, split: bool = True,
                read_bytes: Optional[int] = None) -> tuple[RealKvSource, ...]:
    """One buffer per layer whose row holds a token's K bytes then its V bytes (e.g.
    ``[slots, 2, heads, head_dim]``). With ``split`` (the default) K and V become two sources, so
    PARTIAL mode reads the head of both (and ``read_bytes`` counts in each half); otherwise one
    source spans the whole row."""
    split = check.boolean("split", split)
    out = []
    for name, buffer in _pick(buffers, layers, "buffers"):
        view = native_view(buffer, name)
        whole = from_buffer(view, page_size=1, read_bytes=read_bytes, name=name)  # the buffer's own checks
        if not split:
            out.append(whole)
            continue
        rows = byte_rows(view)  # from_buffer has found its rows contiguous inside
        half = int(rows.shape[1]) // 2
        if half % L.SOURCE_ALIGN_BYTES or 2 * half != rows.shape[1]:
            raise ValueError(f"{check.PREFIX}{name} rows must split into two halves (K, V) of a multiple of 16 "
                             f"bytes, got {rows.shape[1]} bytes per row")
        for part in (rows[:, :half], rows[:, half:]):
            out.append(_source(name, part, 1, half, read_bytes))
    return tuple(out)


def mla(buffers: Sequence[Any], *, layers: Optional[Iterable[int]] = None, page_size: Optional[int] = None,
        read_bytes: Optional[int] = None) -> tuple[RealKvSource, ...]:
    """MLA latent buffers per layer: ``[slots, 1, kv_lora_rank + rope_dim]`` (a token a row) or
    ``[pages, page_size, 1, kv_lora_rank + rope_dim]``, whose ``shape[1]`` is the page size (a
    ``page_size`` given for one must equal it). Other shapes: ``from_buffer``."""
    page_size = _given_page_size(page_size)
    out = []
    for name, buffer in _pick(buffers, layers, "buffers"):
        view = native_view(buffer, name)
        # the latent's one head: without it a paged [pages, page_size, latent] would pass for a
        # token a row, its pages' tokens taken for one token's bytes
        if view.ndim not in (3, 4) or view.shape[-2] != 1:
            raise ValueError(f"{check.PREFIX}{name} must be [slots, 1, latent] or [pages, page_size, 1, latent], "
                             f"got shape {check.shape_text(view)} (a paged [pages, page_size, latent] is "
                             f"kc.layouts.from_buffer with page_size=)")
        rows_hold = int(view.shape[1]) if view.ndim == 4 else 1
        if rows_hold == 0:  # the page size taken from the shape: name the buffer, not page_size
            raise ValueError(f"{check.PREFIX}{name} must hold at least one token a page, shape[1] of "
                             f"[pages, page_size, 1, latent], got shape {check.shape_text(view)}")
        if page_size is not None and page_size != rows_hold:
            raise ValueError(f"{check.PREFIX}page_size must be the tokens a row of {name} holds "
                             f"({'shape[1]' if view.ndim == 4 else '1 for [slots, 1, latent]'}), "
                             f"got {page_size} for shape {check.shape_text(view)}")
        out.append(from_buffer(view, page_size=rows_hold, read_bytes=read_bytes, name=name))
    return tuple(out)
