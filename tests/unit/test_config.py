import pytest

from vllm_ascend_chunk.config import ChunkCacheConfig, ChunkCacheConfigError


def test_defaults_match_the_design():
    cfg = ChunkCacheConfig.from_env({})
    assert cfg == ChunkCacheConfig(
        enabled=True,
        size_gb=None,
        lru_threshold=0.9,
        hash_algorithm="sha256",
        delimiter="# #",
        layout="overlap",
        recovery_docs=0,
    )


def test_valid_values_are_parsed():
    cfg = ChunkCacheConfig.from_env(
        {
            "VLLM_ENABLE_CHUNK_CACHE": "False",
            "VLLM_CHUNK_CACHE_SIZE_GB": "0.5",
            "VLLM_CHUNK_CACHE_LRU_THRESHOLD": "1",
            "VLLM_CHUNK_CACHE_HASH_ALGORITHM": "XXHASH",
            "VLLM_CHUNK_DELIMITER": " <doc> ",
            "VLLM_CHUNK_CACHE_LAYOUT": "sequential",
            "VLLM_CHUNK_CACHE_RECOVERY": " Last",
        }
    )
    assert (cfg.enabled, cfg.size_gb, cfg.lru_threshold) == (False, 0.5, 1.0)
    assert (cfg.hash_algorithm, cfg.delimiter, cfg.layout) == ("xxhash", "<doc>", "sequential")
    assert cfg.recovery_docs == 1
    assert "disabled" in cfg.describe()
    on = ChunkCacheConfig.from_env({"VLLM_CHUNK_CACHE_RECOVERY": "LAST:3"})
    assert on.recovery_docs == 3 and "recovery=last:3" in on.describe()
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
        ("VLLM_CHUNK_CACHE_RECOVERY", "suffix", "none, last (= last:1), or last:K"),
        ("VLLM_CHUNK_CACHE_RECOVERY", "last:0", "last:K with K >= 1"),
        ("VLLM_CHUNK_CACHE_RECOVERY", "last:-1", "last:K with K >= 1"),
    ],
)
def test_invalid_values_name_the_variable_and_accepted_values(name, value, accepted):
    with pytest.raises(ChunkCacheConfigError) as err:
        ChunkCacheConfig.from_env({name: value})
    assert name in str(err.value) and accepted in str(err.value) and repr(value) in str(err.value)
