"""The OCI registry store, `oci://HOST[:PORT]/REPO` (DESIGN §6, docs/store-layout.md): a bundle is one OCI image
manifest whose config is bundle.json and whose layers are its files' zstd blobs, tagged `k-<key>`. The v2 API
client with its auth handshake (client.py), the image layout (image.py) and the store (store.py)."""

from __future__ import annotations

from .client import Ref, RegistryClient, RegistryError, parse_challenges, parse_url
from .image import ARTIFACT_TYPE, LAYER_TYPE, MANIFEST_TYPE, Image, ImageError, Layer, key_tag
from .store import BlobMismatch, OciEntry, OciStore

__all__ = ["ARTIFACT_TYPE", "LAYER_TYPE", "MANIFEST_TYPE", "BlobMismatch", "Image", "ImageError", "Layer", "OciEntry",
           "OciStore", "Ref", "RegistryClient", "RegistryError", "key_tag", "parse_challenges", "parse_url"]
