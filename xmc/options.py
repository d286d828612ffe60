"""Value parsers shared by the stages' command lines and config files."""


def parse_bool(text: str) -> bool:
    """``true/false/1/0/yes/no`` (argparse's ``type=bool`` would take ``False`` as true)."""
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected a boolean, got {text!r}")
    return lowered in ("true", "1", "yes")
