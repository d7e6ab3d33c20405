"""The fake of vLLM's layer-wise reload (vllm.model_executor.model_loader.reload): between the two calls the model
takes weights through its load_weights (outside them a load fails, as on vLLM's CPU build, whose weights are repacked
after loading); finishing a reload that was not begun is an error."""


def initialize_layerwise_reload(model) -> None:
    model.reloading = True


def finalize_layerwise_reload(model, model_config) -> None:
    if not model.reloading:
        raise RuntimeError("finalize_layerwise_reload without initialize_layerwise_reload")
    model.reloading = False
