"""The configuration reference, generated from EngineConfig's own metadata (knob) so that it
cannot drift: ``python -m kvserve.config_reference > docs/configuration.md`` writes it, and a
test checks the file against it."""

from __future__ import annotations

from dataclasses import MISSING, fields

from kvserve.config import CONCERNS, SpeculativeConfig, setting_fields

TITLES = {"model": "Model", "cache": "KV cache", "scheduler": "Scheduler", "offload": "KV tiers (offload)",
          "eviction": "KV eviction", "speculative": "Speculative decoding"}


def _default(value: object) -> str:
    if value is None:
        return "unset"  # "none" is also a value some flags take (--quantization none)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def reference_markdown() -> str:
    lines = ["# Configuration reference", "",
             "Every engine setting, by concern. Each is a flag of `kvserve generate` and `kvserve serve`, a key of a",
             "`--config` YAML file (the flag's name without dashes, or with underscores), and an argument of",
             "`LLM(...)` / `EngineConfig.from_settings(...)` (the underscored name; `EngineConfig` holds it in its",
             "concern's part, e.g. `config.cache_config.block_size`); `--print-config` prints the effective values",
             "as YAML. Generated from `kvserve/config.py` by `python -m kvserve.config_reference`.", ""]
    for concern in CONCERNS:
        lines += [f"## {TITLES[concern]}", "", "| flag | `LLM` argument | default | choices | meaning |",
                  "|---|---|---|---|---|"]
        for owner, f in setting_fields():
            meta = f.metadata
            if owner != concern:
                continue
            flags = [flag_name(f.name)] + ([meta["short"]] if meta["short"] else [])
            if f.default is True:  # on by default: --no-... turns it off
                flags.append("--no-" + f.name.replace("_", "-"))
            meaning = meta["help"].replace(" (default: %(default)s)", "").replace("%(default)s", _default(f.default))
            cells = [", ".join(f"`{flag}`" for flag in flags), f"`{f.name}`", _default(f.default),
                     ", ".join(meta["choices"]), meaning.replace("|", "\\|")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["`--speculative-config` takes a JSON object (YAML: a mapping) with these keys, as vLLM's:", "",
              "| key | default |", "|---|---|"]
    for f in fields(SpeculativeConfig):
        default = f.default if f.default is not MISSING else ""
        lines.append(f"| `{f.name}` | {_default(default)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
