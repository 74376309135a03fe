"""The ready callbacks (engine/callbacks/hooks.py says what a callback is), each picked by a file of
configs/callbacks/: `callbacks=[confusion_matrix]`, `callbacks=[text_sample]`."""

from typing import Any

import torch

from .datasets import CHARACTERS, UNKNOWN


class ConfusionMatrix:
    """The validation set's confusion matrix at each validation, as a figure of the MLflow run,
    `confusion_matrix/step_<step>.png`: rows the true classes, columns the predicted ones (a
    classification: the model's outputs are logits shaped (batch, num_classes)). It takes its own
    pass over the validation set after the run's; under ddp and fsdp each process counts its share
    and the counts are summed over all of them (torchmetrics), so the figure holds every sample.
    Class names come from the data's `labels` fact where it gives one. Needs matplotlib."""

    def __init__(self, normalize: bool = False) -> None:
        from matplotlib.figure import Figure  # here: a missing matplotlib stops the run before step 1

        self._figure, self.normalize = Figure, normalize
        self._counts = None

    @torch.no_grad()
    def on_validation_end(self, run: Any, metrics: dict[str, float]) -> None:
        from torchmetrics.classification import MulticlassConfusionMatrix

        if self._counts is None:
            self._counts = MulticlassConfusionMatrix(run.data.facts["num_classes"]).to(run.device)
        for outputs, targets in run.predictions():
            self._counts.update(outputs, targets)
        counts = self._counts.compute().cpu()  # a collective step under ddp and fsdp: every process's
        self._counts.reset()
        if run.tracker.logs:  # drawn only where it is logged
            run.log_figure(
                self._draw(counts, run.data.facts.get("labels")), f"confusion_matrix/step_{run.step:06d}.png"
            )

    def _draw(self, counts: torch.Tensor, labels: list[str] | None) -> Any:
        shown = counts / counts.sum(1, keepdim=True).clamp(min=1) if self.normalize else counts
        size = max(4.0, 0.4 * len(counts))
        figure = self._figure(figsize=(size + 1, size))
        axes = figure.add_subplot()
        image = axes.imshow(shown.numpy(), cmap="Blues")
        figure.colorbar(image, ax=axes)
        names = labels or [str(index) for index in range(len(counts))]
        axes.set(xticks=range(len(names)), yticks=range(len(names)), xlabel="predicted", ylabel="true")
        axes.set_xticklabels(names, rotation=90)
        axes.set_yticklabels(names)
        figure.tight_layout()
        return figure


class TextSample:
    """Text the language model writes from `prompt` at each validation, `length` characters, as a
    text of the MLflow run, `text_sample/step_<step>.txt` (experiment=char_lm: a model whose outputs
    are next-token logits shaped (batch, sequence, vocabulary), over the characters of
    datasets.CHARACTERS). Each character is drawn from the softmax of the logits over
    `temperature`, or the likeliest with temperature 0, by a generator of its own seeded with the
    run's seed and the step: the run's random state, and so its resume, are left as they were.
    Under fsdp every process writes the same text (each forward is a collective step)."""

    def __init__(self, prompt: str = "def ", length: int = 200, temperature: float = 0.8) -> None:
        if not prompt or length < 1 or temperature < 0:
            raise ValueError(
                f"prompt={prompt!r} must not be empty, length={length} at least 1 and temperature={temperature} "
                f"not negative"
            )
        self.prompt, self.length, self.temperature = prompt, length, temperature

    def on_fit_start(self, run: Any) -> None:
        if run.data.facts.get("vocab_size") != len(CHARACTERS) + 1:
            raise ValueError(
                f"text_sample writes the characters of datasets.CHARACTERS ({len(CHARACTERS) + 1} tokens), and this "
                f"data's vocab_size is {run.data.facts.get('vocab_size')}; leave it out (callbacks=[])"
            )

    @torch.no_grad()
    def on_validation_end(self, run: Any, metrics: dict[str, float]) -> None:
        lookup = {character: index for index, character in enumerate(CHARACTERS)}
        tokens = torch.tensor([[lookup.get(character, UNKNOWN) for character in self.prompt]], device=run.device)
        generator = torch.Generator(run.device).manual_seed(run.cfg.seed + run.step)
        block_size = run.data.facts["block_size"]
        run.model.eval()
        for _ in range(self.length):
            with run.autocast():
                logits = run.model(tokens[:, -block_size:])[0, -1].float()
            if self.temperature == 0:
                chosen = logits.argmax().view(1, 1)
            else:
                chosen = torch.multinomial(torch.softmax(logits / self.temperature, -1), 1, generator=generator)[None]
            tokens = torch.cat([tokens, chosen], dim=1)
        run.model.train()
        text = "".join(CHARACTERS[index] if index < UNKNOWN else "?" for index in tokens[0].tolist())
        run.log_text(text, f"text_sample/step_{run.step:06d}.txt")
