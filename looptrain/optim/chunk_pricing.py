"""What the estimator's fake row-chunked steps run (`bf16.priced_chunks`): the layouts of a rounding pass's chunks in
the windows of random bits, the chunks of a rounding pass that run, and the stand-ins for skipped chunks' norms."""

from __future__ import annotations

from collections.abc import Callable

import torch


def window_layouts(used: int, size: int, undrawn: int, window: int, counts: list[int]) -> list[tuple[tuple, int]]:
    """For takes of `counts` bits in turn from windows of `window` bits (`used` of the held one's `size` used,
    `undrawn` bits left to draw), drawing nothing: each take's layout (the window held before it; for each of its
    pieces, the window drawn first or 0, and whether its window is let go after it) and its first piece's size. Two
    takes of one layout run the same ops on tensors of the same sizes, but their first pieces'."""
    found = []
    for count in counts:
        held, pieces, first = size, [], None
        while count > 0:
            drawn = 0
            if used == size:
                size = drawn = min(window, undrawn)
                undrawn, used = undrawn - size, 0
            taken = min(count, size - used)
            used, count = used + taken, count - taken
            first = taken if first is None else first
            released = used == size
            if released:
                used = size = 0
            pieces.append((drawn, released))
        found.append(((held, tuple(pieces)), first))
    return found


def rounding_chunks_run(layouts: list[tuple[tuple, int]]) -> set[int]:
    """Which middle chunks (index 2 on) of a rounding pass run, given each full chunk's layout and first piece from
    the first (`window_layouts`): for each layout, the first chunk from the second on whose first piece is the
    largest of that layout's.

    A chunk of at most one window's bits takes one piece, or two across a window's end: its rounded first piece
    (4 bytes an element) is held while the next window is drawn, the chunk's highest point, and every other op of it
    has the sizes of its layout's. So the chunk of a layout with the largest first piece holds the most of them.
    """
    largest: dict[tuple, tuple[int, int]] = {}
    for index, (layout, first) in enumerate(layouts[1:], start=1):
        if layout not in largest or first > largest[layout][0]:
            largest[layout] = (first, index)
    return {index for _, index in largest.values() if index >= 2}


def zero_norms(norms: list[torch.Tensor], device: torch.device) -> Callable[[int], None]:
    """Stand-ins for the 0-d fp32 norms of `count` skipped chunks, appended to `norms`: one tensor of as many bytes,
    made in one op (`stack_norms` takes it for them)."""
    return lambda count: norms.append(torch.zeros(count, dtype=torch.float32, device=device))


def stack_norms(norms: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(norms)`` of chunks' 0-d norms, where a 1-d tensor stands for several (`zero_norms`): the same
    bytes (views of the 0-d ones, concatenated)."""
    if all(norm.dim() == 0 for norm in norms):
        return torch.stack(norms)
    return torch.cat([norm.reshape(1) if norm.dim() == 0 else norm for norm in norms])
