"""An evaluator of ListOps expressions written apart from the generator (recipes/lra/listops.py),
so that each checks the other: it reads the printed tokens left to right with a stack of open
operators, where the generator evaluates its own tree recursively.

    from listops_eval import evaluate
    evaluate("( ( ( [MED 1 ) 4 ) ] )")     # 2: for two middle values MED takes their mean, rounded down

Accepts LRA's printed form (with parentheses) and the form the model reads (without them).
"""
OPERATORS = {"[MIN", "[MAX", "[MED", "[SM"}


def _reduce(op: str, args):
    if not args:
        raise ValueError(f"{op} without arguments")
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[SM":
        return sum(args) % 10
    # [MED: numpy.median then int(), as LRA's labels: the middle value, or the floor of the mean
    # of the two middle values
    ordered = sorted(args)
    half = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[half]
    return (ordered[half - 1] + ordered[half]) // 2


def evaluate(expression: str) -> int:
    """The value of one expression; ValueError on a malformed one."""
    stack = []  # [operator, arguments so far] of every operator still open
    result = None
    for token in expression.split():
        if token in ("(", ")"):
            continue
        if result is not None:
            raise ValueError(f"tokens after the end of the expression: {token!r}")
        if token in OPERATORS:
            stack.append((token, []))
        elif token == "]":
            if not stack:
                raise ValueError("] without an open operator")
            op, args = stack.pop()
            v = _reduce(op, args)
            if stack:
                stack[-1][1].append(v)
            else:
                result = v
        elif len(token) == 1 and token.isdigit():
            if stack:
                stack[-1][1].append(int(token))
            else:
                result = int(token)
        else:
            raise ValueError(f"not a ListOps token: {token!r}")
    if stack or result is None:
        raise ValueError("unfinished expression")
    return result
