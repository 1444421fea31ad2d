import dataclasses
import re

import pytest

from tests.helpers import REPO
from vllm_ascend_chunk.config.recovery_modes import Recovery
from vllm_ascend_chunk.config.settings import ChunkCacheConfig
from vllm_ascend_chunk.config.variables import VARIABLES, ChunkCacheConfigError, docs_table


def test_defaults_match_the_design():
    """Every field is written out: one left to `ChunkCacheConfig`'s own default would be compared
    with itself (both sides read the same row of `VARIABLES`)."""
    cfg = ChunkCacheConfig.from_env({})
    assert cfg == ChunkCacheConfig(
        enabled=True,
        size_gb=None,
        lru_threshold=0.9,
        hash_algorithm="sha256",
        delimiter="# #",
        layout="sequential",
        recovery=Recovery(),
        host_gb=0.0,
        max_docs=4096,
        max_request_tokens=32768,
        remote_config=None,
    )


def test_valid_values_are_parsed():
    cfg = ChunkCacheConfig.from_env(
        {
            "VLLM_ENABLE_CHUNK_CACHE": "False",
            "VLLM_CHUNK_CACHE_SIZE_GB": "0.5",
            "VLLM_CHUNK_CACHE_LRU_THRESHOLD": "1",
            "VLLM_CHUNK_CACHE_HASH_ALGORITHM": "XXHASH",
            "VLLM_CHUNK_DELIMITER": " <doc> ",
            "VLLM_CHUNK_CACHE_LAYOUT": "Overlap",
            "VLLM_CHUNK_CACHE_RECOVERY": " Last",
            "VLLM_CHUNK_CACHE_MAX_DOCS": "8",
            "VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS": " 1024 ",
        }
    )
    assert (cfg.enabled, cfg.size_gb, cfg.lru_threshold) == (False, 0.5, 1.0)
    assert (cfg.max_docs, cfg.max_request_tokens) == (8, 1024)
    assert (cfg.hash_algorithm, cfg.delimiter, cfg.layout) == ("xxhash", "<doc>", "overlap")
    assert cfg.recovery == Recovery(docs=1)
    assert "disabled" in cfg.describe()
    on = ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_RECOVERY": "LAST:3"})
    assert on.recovery == Recovery(docs=3) and "recovery=last:3" in on.describe()
    select = ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_RECOVERY": "qattn:0.2/8"})
    assert select.recovery == Recovery(fraction=0.2, runs=8) and "recovery=qattn:0.2/8" in select.describe()
    cover = ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_RECOVERY": "cover:0.9/0.15"})
    assert (
        cover.recovery == Recovery(fraction=0.15, runs=16, cover=0.9)
        and "recovery=cover:0.9/0.15" in cover.describe()
    )
    assert "pool=auto" in on.describe() and "pool=0.5 GiB" in ChunkCacheConfig(size_gb=0.5).describe()
    assert ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_SIZE_GB": " "}).size_gb is None  # blank: unset


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("VLLM_ENABLE_CHUNK_CACHE", "maybe", "true"),
        ("VLLM_CHUNK_CACHE_SIZE_GB", "-1", "greater than 0"),
        ("VLLM_CHUNK_CACHE_SIZE_GB", "lots", "greater than 0"),
        ("VLLM_CHUNK_CACHE_SIZE_GB", "nan", "greater than 0"),
        ("VLLM_CHUNK_CACHE_LRU_THRESHOLD", "1.5", "(0, 1]"),
        ("VLLM_CHUNK_CACHE_LRU_THRESHOLD", "0", "(0, 1]"),
        ("VLLM_CHUNK_CACHE_HASH_ALGORITHM", "md5", "sha256, xxhash"),
        ("VLLM_CHUNK_DELIMITER", "   ", "not blank"),
        ("VLLM_CHUNK_CACHE_LAYOUT", "interleaved", "overlap, sequential"),
        ("VLLM_CHUNK_CACHE_RECOVERY", "suffix", "none, last (= last:1), last:K with K >= 1, qattn:R"),
        ("VLLM_CHUNK_CACHE_RECOVERY", "last:0", "last:K with K >= 1"),
        ("VLLM_CHUNK_CACHE_RECOVERY", "last:-1", "last:K with K >= 1"),
        ("VLLM_CHUNK_CACHE_REMOTE_MASTER", "127.0.0.1:99999", "port 1-65535"),
        ("VLLM_CHUNK_CACHE_REMOTE_MASTER", "127.0.0.1", "host:port"),
        ("VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S", "1e-6", ">= 0.01"),
        ("VLLM_CHUNK_CACHE_REMOTE_PROTOCOL", "rmda", "tcp, rdma"),
        ("VLLM_CHUNK_CACHE_REMOTE_METADATA", "not-a-url", "http://host:port/"),
        ("VLLM_CHUNK_CACHE_REMOTE_METADATA", "ftp://10.0.0.1/metadata", "http://host:port/"),
        ("VLLM_CHUNK_CACHE_REMOTE_SEGMENT_GB", "-2", ">= 0"),
        ("VLLM_CHUNK_CACHE_REMOTE_PART_MB", "64", "[0.001, 16]"),
        ("VLLM_CHUNK_CACHE_MAX_DOCS", "0", "whole number >= 1"),
        ("VLLM_CHUNK_CACHE_MAX_DOCS", "2.5", "whole number >= 1"),
        ("VLLM_CHUNK_CACHE_MAX_REQUEST_TOKENS", "-16", "whole number >= 1"),
        ("VLLM_CHUNK_CACHE_REMOTE_SECRET_FILE", "/nonexistent/secret", "a readable file"),
    ],
)
def test_invalid_values_name_the_variable_and_accepted_values(name, value, accepted):
    env = {name: value}
    if name.startswith("VLLM_CHUNK_CACHE_REMOTE_") and name != "VLLM_CHUNK_CACHE_REMOTE_MASTER":
        env["VLLM_CHUNK_CACHE_REMOTE_MASTER"] = "10.0.0.1:50051"  # the others are read with it
    with pytest.raises(ChunkCacheConfigError) as err:
        ChunkCacheConfig.from_env(env)
    assert name in str(err.value) and accepted in str(err.value) and repr(value) in str(err.value)


def test_remote_settings_that_are_valid_are_kept():
    remote_config = ChunkCacheConfig.from_env(
        {
            "VLLM_CHUNK_CACHE_REMOTE_MASTER": "10.0.0.1:50051",
            "VLLM_CHUNK_CACHE_REMOTE_METADATA": "etcd://10.0.0.2:2379",
            "VLLM_CHUNK_CACHE_REMOTE_PROTOCOL": "RDMA",
            "VLLM_CHUNK_CACHE_REMOTE_TIMEOUT_S": "0.5",
        }
    ).remote_config
    assert (remote_config.metadata_server, remote_config.protocol, remote_config.timeout_s) == (
        "etcd://10.0.0.2:2379",
        "rdma",
        0.5,
    )
    default = ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_REMOTE_MASTER": "store:50051"}).remote_config
    assert dataclasses.asdict(default) == {  # every field, none left to `RemoteConfig`'s defaults
        "master": "store:50051",
        "metadata_server": "http://store:8080/metadata",
        "protocol": "tcp",
        "device_name": "",
        "segment_bytes": 0,
        "timeout_s": 5.0,
        "part_bytes": 16 * 2**20,
        "local_host": "",
        "buffer_bytes": 64 * 2**20,
        "retry_s": 5.0,
        "queue_bytes": 512 * 2**20,
        "read_queue": 4096,
        "secret": None,
    }


SECRET = "k7Qv2-shared-by-every-instance"


def remote(**env: str) -> dict[str, str]:
    return {"VLLM_CHUNK_CACHE_REMOTE_MASTER": "10.0.0.1:50051", **env}


def test_the_remote_secret_from_the_environment_or_a_file(tmp_path):
    assert ChunkCacheConfig.from_env(remote()).remote_config.secret is None
    from_env = ChunkCacheConfig.from_env(remote(VLLM_CHUNK_CACHE_REMOTE_SECRET=f" {SECRET}\n"))
    assert from_env.remote_config.secret == SECRET.encode()
    path = tmp_path / "secret"
    path.write_bytes(SECRET.encode() + b"\n")  # as `echo` writes it
    from_file = ChunkCacheConfig.from_env(remote(VLLM_CHUNK_CACHE_REMOTE_SECRET_FILE=str(path)))
    assert from_file.remote_config == from_env.remote_config
    # Never in a log line: neither the config's repr nor its description shows it.
    assert SECRET not in repr(from_env) and SECRET not in from_env.describe()
    assert "signed objects" in from_env.describe()
    assert "unsigned objects" in ChunkCacheConfig.from_env(remote()).describe()


def test_a_short_secret_is_refused_without_being_shown(tmp_path):
    with pytest.raises(ChunkCacheConfigError) as err:
        ChunkCacheConfig.from_env(remote(VLLM_CHUNK_CACHE_REMOTE_SECRET="hunter2"))
    assert "VLLM_CHUNK_CACHE_REMOTE_SECRET=<secret of 7 bytes>" in str(err.value)
    assert "at least 16 bytes" in str(err.value) and "hunter2" not in str(err.value)
    path = tmp_path / "secret"
    path.write_text("hunter2\n")
    with pytest.raises(ChunkCacheConfigError, match="a readable file holding at least 16 bytes") as err:
        ChunkCacheConfig.from_env(remote(VLLM_CHUNK_CACHE_REMOTE_SECRET_FILE=str(path)))
    assert "hunter2" not in str(err.value)


def test_both_secret_variables_are_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET)
    env = remote(VLLM_CHUNK_CACHE_REMOTE_SECRET=SECRET, VLLM_CHUNK_CACHE_REMOTE_SECRET_FILE=str(path))
    with pytest.raises(ChunkCacheConfigError, match="are both set; set one of them"):
        ChunkCacheConfig.from_env(env)


def test_the_configuration_page_shows_the_configuration_table():
    """docs/user/configuration.md's table is `docs_table()`, whole (a blank line on each side):
    regenerate it with
    `python -c "from vllm_ascend_chunk.config.variables import docs_table; print(docs_table())"`."""
    page = (REPO / "docs" / "user" / "configuration.md").read_text()
    assert f"\n\n{docs_table()}\n\n" in page


def test_the_readmes_short_settings_table_agrees_with_the_variables():
    """Each row of the README's short table names a variable with its default as the full table has it."""
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `(VLLM_[A-Z_]+)` \| ([^|]+) \|", readme, re.M)
    assert len(rows) >= 5
    defaults = {v.name: v.docs_row().split(" | ")[1] for v in VARIABLES}
    assert {name: default.strip() for name, default in rows} == {name: defaults[name] for name, _ in rows}
