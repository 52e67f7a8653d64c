"""kvpress self-speculation in transformers' hub layout: a folder holding `custom_generate/generate.py`.

    model.generate(input_ids, custom_generate=str(kvpress.speculative.HUB_FOLDER), trust_remote_code=True,
                   draft="sink_window", gamma=4, max_new_tokens=64)

transformers loads this file (it is code, hence trust_remote_code) and calls `generate(model=..., **arguments)` with
generate's own arguments as the caller gave them. They go back to `model.generate` with the callable entry point,
kvpress.speculative.custom_generate, so that transformers prepares the generation config, the logits processors
and the stopping criteria as for any decoding method, and kvpress's checks apply unchanged. Copy the folder into a
model's repository to ship the method with the model.
"""

from kvpress.speculative import custom_generate


def generate(model, **arguments):
    inputs = arguments.pop("inputs", None)
    return model.generate(inputs, custom_generate=custom_generate, **arguments)
