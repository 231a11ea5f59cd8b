"""lm-evaluation-harness against serve.py, offline: a multiple-choice task and a generate_until
task with stop strings, written by the test as local JSON files, run through lm-eval's own
`local-completions` (token-id prompts, echo, logprobs) and `local-chat-completions` clients and
through its `hf` backend on the same weights (float32). Per-sample log-likelihoods must agree
within 1e-4, accuracy and generations exactly."""

import json
import os

import pytest

os.environ.setdefault(
    "HF_DATASETS_OFFLINE", "1"
)  # the tasks' data are local files; no hub is reachable
import lm_eval
from helpers import tiny_checkpoint
from lm_eval.tasks import TaskManager
from test_serve import KEY, serve_checkpoint

QUESTIONS = [
    ("The sky is", ["blue", "green", "loud"], 0),
    ("Two plus two is", ["four", "five"], 0),
    ("Cats say", ["meow", "woof", "moo", "quack"], 0),
    ("Ice is", ["cold", "hot"], 0),
    ("The sun rises in the", ["east", "west"], 0),
    ("Fish live in", ["water", "trees", "sand"], 0),
]


def write_tasks(folder):
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    gen = [{"question": q, "answer": c[a]} for q, c, a in QUESTIONS]
    (folder / "mc.json").write_text("\n".join(json.dumps(d) for d in mc))
    (folder / "gen.json").write_text("\n".join(json.dumps(d) for d in gen))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.json'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.json'}\n"
        "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['.', ',']\n  max_gen_toks: 12\n"
        "  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return TaskManager(include_path=str(folder))


def evaluate(model, model_args, tasks, manager):
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=manager,
        log_samples=True,
        batch_size=1,
        apply_chat_template=model.endswith("chat-completions"),
    )
    return out["results"], out["samples"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, monkeypatch_module):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("lm-eval-tiny"), max_position_embeddings=512)
    url, stop = serve_checkpoint(
        folder, num_blocks=600, block_size=16, max_num_seqs=8, max_num_batched_tokens=1024
    )
    monkeypatch_module.setenv("OPENAI_API_KEY", KEY)
    manager = write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))
    yield folder, url, manager
    stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def loglikelihoods(samples):
    return [
        [float(r[0][0]) for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])
    ]


def generations(samples):
    return [s["filtered_resps"][0] for s in sorted(samples, key=lambda s: s["doc_id"])]


def test_lm_eval_through_serve_equals_lm_eval_on_hf(setup):
    folder, url, manager = setup
    ours, ours_samples = evaluate(
        "local-completions",
        f"base_url={url}/v1/completions,model=tiny,tokenizer={folder},tokenized_requests=True,"
        "tokenizer_backend=huggingface,max_retries=1",
        ["tiny_mc", "tiny_gen"],
        manager,
    )
    hf, hf_samples = evaluate(
        "hf", f"pretrained={folder},dtype=float32,device=cpu", ["tiny_mc", "tiny_gen"], manager
    )
    a, b = loglikelihoods(ours_samples["tiny_mc"]), loglikelihoods(hf_samples["tiny_mc"])
    assert [len(x) for x in a] == [len(c) for _, c, _ in QUESTIONS] == [len(x) for x in b]
    for x, y in zip(a, b):
        assert x == pytest.approx(y, abs=1e-4)
    assert ours["tiny_mc"]["acc,none"] == hf["tiny_mc"]["acc,none"]
    assert generations(ours_samples["tiny_gen"]) == generations(hf_samples["tiny_gen"])
    assert ours["tiny_gen"]["exact_match,none"] == hf["tiny_gen"]["exact_match,none"]


def test_lm_eval_chat_completions_runs_a_generate_until_task(setup):
    folder, url, manager = setup
    results, samples = evaluate(
        "local-chat-completions",
        f"base_url={url}/v1/chat/completions,model=tiny,max_retries=1",
        ["tiny_gen"],
        manager,
    )
    assert len(samples["tiny_gen"]) == len(QUESTIONS)
    assert all(isinstance(g, str) for g in generations(samples["tiny_gen"]))
    assert "exact_match,none" in results["tiny_gen"]
