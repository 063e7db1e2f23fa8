"""Load other codebases' checkpoints into vitmm models, from local files only.

``hf``: Hugging Face transformers CLIP (``CLIPModel``, ``CLIPVisionModel``, ``CLIPTextModel``),
``ViTModel``, ``Dinov2Model`` and ``Dinov2WithRegistersModel`` (transformers 5.x and legacy key
names), SigLIP, and export of the CLIP vision tower back to the transformers layout; ``timm_vit``:
timm ``VisionTransformer`` state dicts; ``openclip``: open_clip ``CLIP``; ``big_vision``: big_vision
(and vision_transformer AugReg) ``.npz`` ViTs and two towers; ``hf_lm``: transformers Llama,
Qwen2 and Gemma causal LMs. Each loader returns the vitmm model's
keyword arguments and its parameters; anything the file holds that the model has no place for,
anything the model needs that the file lacks, and every shape mismatch is listed in one error.
Parity with the original implementations is tested on committed fixtures (``tests/interop``).
"""
