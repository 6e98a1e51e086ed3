"""Prefix-cache block hashes: SHA-256 over the encoding BlockManager.block_hashes documents,
chained block to block from a root holding the cache salt."""

import hashlib

from hookllm import SamplingParams
from hookllm.sched.block_manager import BlockManager
from hookllm.sched.request import MultiModalItem, Request

BLOCK_SIZE = 16


def u64(value: int) -> bytes:
    return value.to_bytes(8, "little")


def i64(value: int) -> bytes:
    return value.to_bytes(8, "little", signed=True)


def string(text: str) -> bytes:
    data = text.encode("utf-8")
    return u64(len(data)) + data


def expected_block_hash(parent: bytes, token_ids: list[int], images: list[tuple[str, int]]) -> bytes:
    """The documented encoding, built here field by field."""
    message = b"\x02" + parent + u64(len(token_ids)) + b"".join(i64(t) for t in token_ids) + u64(len(images))
    message += b"".join(string(content_hash) + i64(offset) for content_hash, offset in images)
    return hashlib.sha256(message).digest()


def hashes(prompt: list[int], num_blocks: int, cache_salt: str | None = None,
           images: tuple[MultiModalItem, ...] = ()) -> list[bytes]:
    request = Request("r", prompt, SamplingParams(), cache_salt=cache_salt)
    request.mm_items = list(images)
    return BlockManager(4, BLOCK_SIZE, enable_prefix_caching=True).block_hashes(request, num_blocks)


def test_the_first_block_hash_is_sha256_of_the_documented_encoding():
    prompt = [7, 0, 151_000, 3, 2**40, *range(100, 111), 9]
    root = hashlib.sha256(b"\x00").digest()
    assert hashes(prompt, 1) == [expected_block_hash(root, prompt[:16], [])]


def test_a_salted_image_block_hash_is_sha256_of_the_documented_encoding():
    prompt = list(range(30, 46))
    image = MultiModalItem("image", 5, 20, "säge-42")  # non-ASCII: its length is counted in bytes
    root = hashlib.sha256(b"\x01" + string("tenant-a")).digest()
    assert hashes(prompt, 1, "tenant-a", (image,)) == [expected_block_hash(root, prompt, [("säge-42", 5)])]


def test_different_salts_give_different_first_block_hashes():
    prompt = list(range(2, 18))
    firsts = {hashes(prompt, 1, salt)[0] for salt in (None, "", "tenant-a", "tenant-b")}
    assert len(firsts) == 4


def test_the_second_block_hash_chains_from_the_first():
    second_block = list(range(50, 66))
    a, b = hashes(list(range(2, 18)) + second_block, 2), hashes(list(range(3, 19)) + second_block, 2)
    assert a[1] != b[1]
    assert a[1] == expected_block_hash(a[0], second_block, [])


def test_an_image_offset_inside_the_block_changes_its_hash():
    prompt = [5] * 32
    at_3, at_4 = (hashes(prompt, 2, images=(MultiModalItem("image", offset, 20, "cat"),)) for offset in (3, 4))
    assert at_3[0] != at_4[0]
    # The image runs on into the second block: its offset from that block's start is negative.
    assert at_3[1] == expected_block_hash(at_3[0], prompt[16:], [("cat", 3 - 16)])


def test_hashes_extend_as_decoded_tokens_fill_blocks():
    manager = BlockManager(4, BLOCK_SIZE, enable_prefix_caching=True)
    request = Request("r", list(range(2, 22)), SamplingParams())
    first = manager.block_hashes(request, 1)
    for token in range(200, 212):
        request.append_output_token(token)
    assert request.block_hashes == first  # nothing hashed until a caller asks for more blocks
    second = expected_block_hash(first[0], request.all_token_ids[16:32], [])
    assert manager.block_hashes(request, 2) == request.block_hashes == first + [second]
