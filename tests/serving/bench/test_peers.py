"""`serving.bench.peers`: what its committed JSON names the checkpoint by."""

from serving.bench.peers import _portable


def test_the_json_names_no_folder_of_this_machine(monkeypatch):
    monkeypatch.setenv("PEER_DIR", "/data/peer/")
    assert _portable("/data/peer/tiny-v4") == "$PEER_DIR/tiny-v4"
    assert _portable("/elsewhere/ckpts/tiny-v4") == "tiny-v4"  # outside $PEER_DIR: the folder's name
    monkeypatch.delenv("PEER_DIR")
    assert _portable("/data/peer/tiny-v4") == "tiny-v4"
    assert _portable("small") == "small"  # a preset or a relative path stays as given
