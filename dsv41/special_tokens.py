"""V4.1's special tokens, in id order: the first ids of every tokenizer this project builds (the serving byte-level
tokenizer and the nano model's trained BPE), so chat encoding works with either and Engram's pad id is 2.

(text, special): special=False marks the markers the reasoning / tool-call parsers read from generated text, which
must survive decode(skip_special=True).
"""

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML_TOKEN = "｜DSML｜"

SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS_TOKEN, True),
    (EOS_TOKEN, True),
    (PAD_TOKEN, True),
    ("<｜System｜>", True),
    ("<｜User｜>", True),
    ("<｜Assistant｜>", True),
    ("<｜latest_reminder｜>", True),
    ("<｜deepseek_image｜>", True),
    (THINK_START, False),
    (THINK_END, False),
    (DSML_TOKEN, False),
    ("<｜action｜>", True),
    ("<｜query｜>", True),
    ("<｜authority｜>", True),
    ("<｜domain｜>", True),
    ("<｜title｜>", True),
    ("<｜read_url｜>", True),
)
