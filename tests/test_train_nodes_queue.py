"""The training nodes' STRING inputs are read when the prompt is queued (VALIDATE_INPUTS): a bucket list
or a LoRA name that does not parse is refused before any node runs, not after the loader spent
minutes on the model (review r21). ComfyUI checks nothing of a STRING itself."""

from __future__ import annotations

import pytest

from vidmem.nodes.train import VidMemPrepareTrainingData, VidMemTrainLoRA


@pytest.mark.parametrize("inputs, refusal", [
    (dict(resolutions="832x48O"), "resolutions: '832x48O' is not WIDTHxHEIGHT"),
    (dict(resolutions=" , "), "resolutions is empty"),
    (dict(frame_buckets="33, x"), "frame_buckets: 'x' is not a frame count"),
    (dict(frame_buckets=""), "frame_buckets is empty"),
])
def test_prepare_refuses_bucket_lists_that_do_not_parse(inputs, refusal):
    answer = VidMemPrepareTrainingData.VALIDATE_INPUTS(**inputs)
    assert isinstance(answer, str) and answer.startswith(refusal), answer


@pytest.mark.parametrize("inputs, refusal", [
    (dict(lora_name="../my"), "lora_name='../my' must be a plain file name"),
    (dict(lora_name="styles/my"), "lora_name='styles/my' must be a plain file name"),
    (dict(target_modules=" , "), "target_modules is empty"),
])
def test_train_refuses_names_that_do_not_parse(inputs, refusal):
    answer = VidMemTrainLoRA.VALIDATE_INPUTS(**inputs)
    assert isinstance(answer, str) and answer.startswith(refusal), answer


def test_good_or_linked_strings_queue():
    assert VidMemPrepareTrainingData.VALIDATE_INPUTS(resolutions="832x480, 480x832", frame_buckets="33, 17") is True
    assert VidMemPrepareTrainingData.VALIDATE_INPUTS(resolutions=None, frame_buckets=None) is True  # linked
    assert VidMemTrainLoRA.VALIDATE_INPUTS(lora_name="my_style.safetensors", target_modules="to_q,to_v") is True
    assert VidMemTrainLoRA.VALIDATE_INPUTS(lora_name=None, target_modules=None) is True  # linked
