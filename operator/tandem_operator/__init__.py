"""tandem operator: reconciles `InferenceService` objects into prefill, decode and router workloads.

Never import the engine (or torch) from here: the operator image has neither.
"""

from __future__ import annotations

GROUP = "serving.tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION"]
