"""One bounded walk over an object graph whose nodes may be shared (a pickle's memo, YAML's aliases): each distinct
node measured once, iteratively (a deep graph must not exhaust Python's stack), for what walking it would
expand to, how deep it nests and whether it contains itself. The pickle and YAML readers refuse past their limits."""

from __future__ import annotations

from typing import Any, Callable


def check_bounded(root: Any, children: Callable[[Any], list | None], max_depth: int, max_expanded: int,
                  refusal: Callable[[str], Exception], on_shared: Callable[[], None] = lambda: None,
                  back_reference: Callable[[Any], bool] = lambda node: False) -> None:
    """Raise `refusal(kind)` when the graph from `root` expands past `max_expanded` nodes ("expanded"), nests deeper
    than `max_depth` ("depth") or contains itself ("loop"). `children(node)` is None for a leaf; `on_shared()` is
    told of each node reached again; a node for which `back_reference` is true is no loop (a leaf there)."""
    expanded: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, int, bool]] = [(root, 0, False)]  # post-order
    while stack:
        node, depth, done = stack.pop()
        nodes = children(node)
        if nodes is None:
            continue
        key = id(node)
        if done:
            on_path.discard(key)
            expanded[key] = 1 + sum(expanded.get(id(c), 1) for c in nodes)
            if expanded[key] > max_expanded:
                raise refusal("expanded")
            continue
        if key in expanded:
            on_shared()
            continue
        if key in on_path:
            if back_reference(node):
                expanded[key] = 1
                continue
            raise refusal("loop")
        if depth > max_depth:
            raise refusal("depth")
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in nodes)
