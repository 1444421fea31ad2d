import pytest

from tests.helpers import REPO
from vllm_ascend_chunk.config import ChunkCacheConfig, ChunkCacheConfigError, Recovery, docs_table


def test_defaults_match_the_design():
    cfg = ChunkCacheConfig.from_env({})
    assert cfg == ChunkCacheConfig(
        enabled=True,
        size_gb=None,
        lru_threshold=0.9,
        hash_algorithm="sha256",
        delimiter="# #",
        layout="sequential",
        recovery=Recovery(),
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
        }
    )
    assert (cfg.enabled, cfg.size_gb, cfg.lru_threshold) == (False, 0.5, 1.0)
    assert (cfg.hash_algorithm, cfg.delimiter, cfg.layout) == ("xxhash", "<doc>", "overlap")
    assert cfg.recovery == Recovery(docs=1)
    assert "disabled" in cfg.describe()
    on = ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_RECOVERY": "LAST:3"})
    assert on.recovery == Recovery(docs=3) and "recovery=last:3" in on.describe()
    select = ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_RECOVERY": "qattn:0.2/8"})
    assert select.recovery == Recovery(select=0.2, runs=8) and "recovery=qattn:0.2/8" in select.describe()
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
        ("VLLM_CHUNK_CACHE_RECOVERY", "suffix", "none, last (= last:1), last:K with K >= 1, or qattn:R"),
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
    assert default.metadata_server == "http://store:8080/metadata"


def test_the_readme_shows_the_configuration_table():
    """README.md's table is `docs_table()`, whole (a blank line on each side): regenerate it with
    `python -c "from vllm_ascend_chunk.config import docs_table; print(docs_table())"`."""
    readme = (REPO / "README.md").read_text()
    assert f"\n\n{docs_table()}\n\n" in readme
