"""--config FILE.yaml: flag names as keys, the command line wins, errors name file, key and value."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvserve.cli import main


def printed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main([*argv, "--print-config"]) == 0
    return dict(yaml.safe_load(capsys.readouterr().out))


def test_file_sets_flags_and_the_command_line_wins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "kvserve.yaml"
    config.write_text("# tuned\nblock-size: 32\nmax_num_seqs: 8\nkv-cache-dtype: int8\nenable-prefix-caching: false\n"
                      "kv-cache-dtype-skip-layers: [0, 29]\n"
                      "speculative-config: {method: ngram, num_speculative_tokens: 3}\nport: 9001\n")
    defaults = printed(capsys, "serve")
    effective = printed(capsys, "serve", "--config", str(config), "--max-num-seqs", "4", "--enable-prefix-caching")
    assert effective["block-size"] == 32 and effective["kv-cache-dtype"] == "int8" and effective["port"] == 9001
    assert effective["max-num-seqs"] == 4 and effective["enable-prefix-caching"] is True  # the command line wins
    assert effective["kv-cache-dtype-skip-layers"] == [0, 29]
    assert yaml.safe_load(str(effective["speculative-config"])) == {"method": "ngram", "num_speculative_tokens": 3}
    changed = {k for k in defaults if defaults[k] != effective[k]}
    assert changed == {"block-size", "max-num-seqs", "kv-cache-dtype", "kv-cache-dtype-skip-layers",
                       "speculative-config", "port"}
    # what --print-config writes, --config reads back to the same configuration
    again = tmp_path / "printed.yaml"
    again.write_text(yaml.safe_dump(effective))
    assert printed(capsys, "serve", "--config", str(again)) == effective
    bench = tmp_path / "bench.yaml"
    bench.write_text("concurrency: 1,2\nnum-prompts: 3\nslo-ttft: 2\n")
    swept = printed(capsys, "bench", "serve", "--config", str(bench), "--num-prompts", "5")
    assert (swept["concurrency"], swept["num-prompts"], swept["slo-ttft"]) == ("1,2", 5, 2.0)


@pytest.mark.parametrize("text,extra,message", [
    ("blocksize: 32\n", [], "unknown key 'blocksize' (this command takes: api-key, block-size"),
    ("block-size: abc\n", [], "key 'block-size': bad value 'abc'"),
    ("block-size: 24\n", [], "key 'block-size': bad value 24: block_size must be a power of two"),
    ("kv-cache-dtype: int9\n", [], "key 'kv-cache-dtype': bad value 'int9'"),
    ("kv-eviction: lru\n", [], "key 'kv-eviction': bad value 'lru': expected one of none, streaming, snapkv"),
    ("enable-prefix-caching: maybe\n", [], "key 'enable-prefix-caching': bad value 'maybe': expected true or false"),
    ("max-num-seqs: null\n", [], "key 'max-num-seqs': bad value None: null is only allowed"),
    ("preemption-mode: swap\n", [], "key 'preemption-mode': bad value 'swap': preemption_mode=swap"),
    ("- block-size\n", [], "expected a mapping of flag names to values, got list"),
    ("block-size: [32\n", [], "not valid YAML"),
    ("config: other.yaml\n", [], "unknown key 'config'"),
])
def test_bad_files_name_the_file_key_and_value(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                              extra: list[str], message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert main(["serve", "--config", str(config), *extra, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert f"kvserve: error: {config}: {message}" in err


def test_a_setting_the_command_line_fixes_is_not_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "swap.yaml"
    config.write_text("preemption-mode: swap\n")
    assert printed(capsys, "serve", "--config", str(config), "--kv-offload-memory", "1GiB")["preemption-mode"] == "swap"
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "--config" in capsys.readouterr().err


def test_every_setting_is_one_flag_one_file_key_and_one_reference_row(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI flags, the --config keys, --print-config and docs/configuration.md all come from
    EngineConfig's metadata: a setting added there appears in each; the reference on disk is the
    generated one (regenerate: python -m kvserve.config_reference > docs/configuration.md)."""
    from kvserve.config import EngineConfig, setting_fields
    from kvserve.config_reference import reference_markdown

    settings = {f.name: f for _, f in setting_fields()}
    assert all(f.metadata["help"] for f in settings.values())
    # each setting lives in its concern's part of EngineConfig, and from_settings puts it there
    config = EngineConfig.from_settings(block_size=32, kv_window=64, max_num_seqs=3, kv_offload_memory="1MiB")
    assert (config.cache_config.block_size, config.eviction_config.kv_window, config.scheduler_config.max_num_seqs,
            config.offload_config.kv_offload_memory) == (32, 64, 3, 2**20)
    assert EngineConfig.from_settings(**config.settings()) == config
    effective = printed(capsys, "generate", "hi")
    for name, setting in settings.items():  # every setting is a flag, printed with its default...
        default = list(setting.default) if isinstance(setting.default, tuple) else setting.default
        assert effective[name.replace("_", "-")] == default, name
    config = tmp_path / "all.yaml"  # ...and the printed YAML is a file --config reads back unchanged
    config.write_text(yaml.safe_dump(effective))
    assert printed(capsys, "generate", "hi", "--config", str(config)) == effective
    reference = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert reference == reference_markdown(), "docs/configuration.md is stale: python -m kvserve.config_reference"
    assert all(f"`{name}`" in reference for name in settings)
