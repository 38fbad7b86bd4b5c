"""Fixed prompts for the peer benchmark: the same bytes go to every server.

Decode prompts ask for long, open-ended text so a server that cannot ignore EOS
still decodes the full ``max_tokens`` with greedy sampling; the client reports
the tokens each server really produced.
"""

from __future__ import annotations

DECODE_TOPICS = [
    "the history of the printing press",
    "how a steam engine works",
    "the life cycle of a star",
    "the rules of chess",
    "how bread is baked",
    "the water cycle",
    "how a bicycle is built",
    "the migration of birds",
    "the invention of the telephone",
    "how volcanoes form",
    "the history of the Roman roads",
    "how a lighthouse works",
    "the growth of a tree",
    "how paper is made",
    "the tides of the ocean",
    "how a clock keeps time",
]

LONG_QUESTION = "Which rooms were warmest, and what pattern do you see in the readings?"
NEW_TURN = "Thanks. Now list the three coldest readings."

ROOMS = ["kitchen", "library", "attic", "cellar", "hall", "study", "garage", "porch"]


def decode_messages(i: int, nonce: str) -> list[dict[str, str]]:
    """A long-answer request for stream ``i``. ``nonce`` opens the user turn, so no
    request reuses another's prompt (from this row or an earlier one) beyond the
    chat template's fixed opening: the rows measure batching, not the prefix cache."""
    topic = DECODE_TOPICS[i % len(DECODE_TOPICS)]
    return [
        {
            "role": "user",
            "content": f"Request {nonce}-{i}: write a very long, detailed essay about "
            f"{topic}, with many sections and examples.",
        }
    ]


def sensor_log(num_lines: int) -> str:
    """A deterministic, natural-looking log; ~17 tokens per line with SmolLM2's tokenizer."""
    lines = []
    for n in range(num_lines):
        room = ROOMS[(n * 5) % len(ROOMS)]
        temp = 14 + (n * 7) % 13
        lines.append(f"Reading {n + 1}: the sensor in the {room} measured {temp} degrees.")
    return "\n".join(lines)


def long_messages(session: str, num_lines: int = 80) -> list[dict[str, str]]:
    """~1,400 prompt tokens (80 lines) whose first tokens name ``session``, so each
    session is cold on any prefix cache."""
    return [
        {"role": "system", "content": f"Session {session}. You answer from the log below."},
        {"role": "user", "content": f"{sensor_log(num_lines)}\n\n{LONG_QUESTION}"},
    ]


def next_turn(messages: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    """The conversation as a chat client sends it back: its answer plus one short turn."""
    turn = [{"role": "assistant", "content": answer}, {"role": "user", "content": NEW_TURN}]
    return [*messages, *turn]


# An agent session (run_peers' "agent session" row): a coding agent's loop of tool
# results and short questions. Each tool result is ~300 tokens (SmolLM2's tokenizer).
AGENT_SYSTEM = (
    "Session {session}. You are a coding assistant working in the repository `inventory`. "
    "After each tool result, answer the question in one short sentence."
)
AGENT_MODULES = ["orders", "stock", "billing", "shipping", "users"]
AGENT_QUESTIONS = [
    "Which file should I open first?",
    "Does this function handle an empty list?",
    "Which test failed, and why?",
    "Which files mention the discount?",
    "What does this change do?",
]


def _file_listing(turn: int) -> str:
    """``ls -l`` of a source folder."""
    module = AGENT_MODULES[turn % len(AGENT_MODULES)]
    names = ["__init__", "models", "views", "service", "storage", "errors", "schema"]
    names += ["cli", "utils"]
    lines = [f"$ ls -l src/{module}/", f"total {48 + turn}"]
    for n, name in enumerate(names):
        size = 120 + (n * 733 + turn * 97) % 9000
        lines.append(f"-rw-r--r-- 1 dev dev {size:5d} Nov {10 + n} 14:{n * 4:02d} {name}.py")
    return "\n".join(lines)


def _code_snippet(turn: int) -> str:
    """``cat`` of a short Python function."""
    module = AGENT_MODULES[turn % len(AGENT_MODULES)]
    return f'''$ sed -n 40,75p src/{module}/service.py
def total_{module}(items, discount=0.0, tax_rate=0.{turn + 1}):
    """Sum the {module} line items, apply the discount, then the tax."""
    if discount < 0 or discount > 1:
        raise ValueError(f"discount must be in [0, 1], got {{discount}}")
    subtotal = 0.0
    for item in items:
        price = item["price"] * item.get("quantity", 1)
        if item.get("taxable", True):
            price *= 1 + tax_rate
        subtotal += price
    total = subtotal * (1 - discount)
    if total > {1000 * (turn + 1)}:
        log.info("large {module} total: %.2f", total)
    return round(total, 2)


def average_{module}(items):
    """Mean price of the {module} items."""
    return total_{module}(items) / len(items)


def cheapest_{module}(items, limit=3):
    """The ``limit`` cheapest {module} items, cheapest first."""
    return sorted(items, key=lambda item: item["price"])[:limit]'''


def _test_log(turn: int) -> str:
    """A pytest run with one failure."""
    module = AGENT_MODULES[turn % len(AGENT_MODULES)]
    lines = ["$ pytest -q tests/", "platform linux -- Python 3.11.7, pytest-8.3.3"]
    lines += ["rootdir: /home/dev/inventory, configfile: pyproject.toml"]
    lines += [f"collected {40 + turn} items", ""]
    for n in range(5):
        marks = "." * (8 - n) + ("F" if n == 2 else "") + "." * (2 + n)
        lines.append(f"tests/test_{AGENT_MODULES[n]}.py {marks:<14} [{(n + 1) * 20:3d}%]")
    lines += [
        "",
        "=================================== FAILURES ===================================",
        f"_____________________ test_average_{module}_of_no_items ______________________",
        f"    def test_average_{module}_of_no_items():",
        f">       assert average_{module}([]) == 0",
        f"src/{module}/service.py:57: in average_{module}",
        f"    return total_{module}(items) / len(items)",
        "E   ZeroDivisionError: float division by zero",
        "=========================== short test summary info ============================",
        f"FAILED tests/test_{module}.py::test_average_{module}_of_no_items - ZeroDivisionError",
        f"1 failed, {39 + turn} passed in {1.5 + turn * 0.25:.2f}s",
    ]
    return "\n".join(lines)


def _grep_output(turn: int) -> str:
    """``grep -rn`` over the sources."""
    lines = ['$ grep -rn "discount" src/ tests/']
    for n, module in enumerate(AGENT_MODULES * 2):
        line_no = 12 + (n * 37 + turn * 11) % 300
        where = f"src/{module}/service.py:{line_no}:    "
        text = f"discount = settings.get('{module}_discount', 0.{n % 4})"
        if n >= len(AGENT_MODULES):
            where = f"tests/test_{module}.py:{line_no}:    "
            text = f"assert total_{module}(items, discount=0.{n % 9}) == {turn + n}.0"
        lines.append(where + text)
    return "\n".join(lines)


def _git_diff(turn: int) -> str:
    """``git diff`` of a one-function fix."""
    module = AGENT_MODULES[turn % len(AGENT_MODULES)]
    return f"""$ git diff src/{module}/service.py
diff --git a/src/{module}/service.py b/src/{module}/service.py
index 3f{turn}a1c2..9b{turn}e4d7 100644
--- a/src/{module}/service.py
+++ b/src/{module}/service.py
@@ -54,7 +54,9 @@ def total_{module}(items, discount=0.0, tax_rate=0.{turn + 1}):
     return round(total, 2)


 def average_{module}(items):
     \"\"\"Mean price of the {module} items.\"\"\"
-    return total_{module}(items) / len(items)
+    if not items:
+        return 0.0
+    return total_{module}(items) / len(items)
@@ -88,6 +90,8 @@ def export_{module}(rows, path):
     with open(path, "w", encoding="utf-8") as out:
         writer = csv.writer(out)
+        writer.writerow(["id", "name", "price", "quantity"])
         for row in rows:
             writer.writerow([row.id, row.name, row.price, row.quantity])
+    log.info("exported %d {module} rows to %s", len(rows), path)"""


AGENT_TOOLS = [_file_listing, _code_snippet, _test_log, _grep_output, _git_diff]


def agent_turn(turn: int) -> str:
    """Turn ``turn``'s user message: a tool result and a short question about it."""
    kind = turn % len(AGENT_TOOLS)
    return f"Tool result:\n{AGENT_TOOLS[kind](turn)}\n\n{AGENT_QUESTIONS[kind]}"


def agent_messages(session: str, turn: int, answers: list[str]) -> list[dict[str, str]]:
    """The conversation an agent sends at ``turn`` (0-based): the system prompt, every
    earlier turn with the server's own answer to it (``answers[:turn]``), the new turn."""
    if len(answers) < turn:
        raise ValueError(f"turn {turn} needs the {turn} earlier answers, got {len(answers)}")
    messages = [{"role": "system", "content": AGENT_SYSTEM.format(session=session)}]
    for k in range(turn):
        messages.append({"role": "user", "content": agent_turn(k)})
        messages.append({"role": "assistant", "content": answers[k]})
    messages.append({"role": "user", "content": agent_turn(turn)})
    return messages
