//! `--set KEY=VALUE`: a train block's setting overridden from the command line, as
//! torchtitan's `--section.key=value` and Hugging Face's arguments do. `KEY` is a
//! setting (`seed`, `optimizer`) or an argument of one written as a call
//! (`optimizer.lr`, `data.vocab`, `lr_schedule.warmup`); `VALUE` is DSL text, as the
//! block would hold it. Each override rewrites the source's text where the setting or
//! the argument is written (or adds it), so the lowering checks and locates it as it
//! checks what the file says.

use super::ast::{ExprKind, TrainBlock};
use super::error::did_you_mean;
use super::parser;
use super::train::KEYS;

/// `KEY=VALUE` split and checked for its form.
fn split(set: &str) -> Result<(&str, Option<&str>, &str), String> {
    let (key, value) = set.split_once('=').ok_or_else(|| {
        format!("--set {set}: give KEY=VALUE (`--set optimizer.lr=3e-4`, `--set seed=2`)")
    })?;
    let (key, value) = (key.trim(), value.trim());
    if value.is_empty() {
        return Err(format!("--set {set}: `{key}` is given no value"));
    }
    let (setting, arg) = match key.split_once('.') {
        Some((s, a)) => (s, Some(a)),
        None => (key, None),
    };
    if !KEYS.iter().any(|(k, _)| *k == setting) {
        let names: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
        let hint = did_you_mean(setting, names.iter().copied())
            .map_or(String::new(), |s| format!(" ({s})"));
        return Err(format!(
            "--set {set}: `{setting}` is not a setting of the train block{hint}; the settings \
             are: {}",
            names.join(", ")
        ));
    }
    if let Some(a) = arg {
        if a.is_empty() || !a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!(
                "--set {set}: `{a}` is not an argument name (`{setting}.lr`)"
            ));
        }
    }
    parser::check_expression(value).map_err(|e| format!("--set {set}: `{value}`: {e}"))?;
    Ok((setting, arg, value))
}

/// The train block of `src`, or why there is none to override.
fn train_block(src: &str) -> Result<TrainBlock, String> {
    let file = parser::parse(src).map_err(|d| d.message)?;
    file.trains
        .into_iter()
        .next()
        .ok_or_else(|| "the file has no `train` block to override".to_string())
}

/// `src` with each of `sets` applied in order. An error names the `--set` and what
/// it can be. A file that does not parse is returned as it is, for the compiler to
/// report where it is wrong.
pub fn apply(src: &str, sets: &[String]) -> Result<String, String> {
    let mut text = src.to_string();
    for set in sets {
        let (setting, arg, value) = split(set)?;
        let train = match train_block(&text) {
            Ok(t) => t,
            Err(_) if parser::parse(&text).is_err() => return Ok(text),
            Err(e) => return Err(format!("--set {set}: {e}")),
        };
        let entry = train.entries.iter().find(|e| e.key.name == setting);
        let (at, remove, insert) = match (entry, arg) {
            (Some(e), None) => (e.value.span.start, e.value.span.end, value.to_string()),
            (None, None) => (
                train.close.start,
                train.close.start,
                format!("  {setting} = {value}\n"),
            ),
            (None, Some(a)) => {
                return Err(format!(
                    "--set {set}: the train block sets no `{setting}` whose `{a}` to change: \
                     give the whole setting (`--set {setting}=...`)"
                ))
            }
            (Some(e), Some(a)) => match &e.value.kind {
                ExprKind::Call { args, .. } => {
                    match args
                        .iter()
                        .find(|x| x.name.as_ref().is_some_and(|n| n.name == a))
                    {
                        Some(x) => (x.value.span.start, x.value.span.end, value.to_string()),
                        None => {
                            // Before the closing parenthesis, after the last argument.
                            let close = e.value.span.end - 1;
                            let sep = if args.is_empty() { "" } else { ", " };
                            let after = args.last().map_or(close, |x| x.span.end);
                            (after, after, format!("{sep}{a} = {value}"))
                        }
                    }
                }
                ExprKind::Name(_) => (
                    e.value.span.end,
                    e.value.span.end,
                    format!("({a} = {value})"),
                ),
                _ => {
                    return Err(format!(
                        "--set {set}: `{setting}` is `{}`, which takes no arguments: give the \
                         whole setting (`--set {setting}=...`)",
                        &text[e.value.span.start..e.value.span.end]
                    ))
                }
            },
        };
        text.replace_range(at..remove, &insert);
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::apply;

    const SRC: &str = "model m {\n  input x: f32[B, 2]\n  input y: i32[B]\n  \
        param w: f32[2, 2] = glorot\n  minimize softmax_cross_entropy(x @ w, y)\n}\n\
        train {\n  data = gaussian_classes(features = 2, classes = 2)\n  batch = 4\n  \
        optimizer = adam(lr = 0.01)\n  steps = 10\n}\n";

    fn set(sets: &[&str]) -> Result<String, String> {
        apply(SRC, &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn a_setting_or_an_argument_is_rewritten_or_added_where_it_is_written() {
        let t = set(&[
            "optimizer.lr=3e-4",
            "seed=2",
            "steps = 20",
            "optimizer.beta2=0.95",
        ])
        .expect("applies");
        assert!(
            t.contains("optimizer = adam(lr = 3e-4, beta2 = 0.95)"),
            "{t}"
        );
        assert!(
            t.contains("steps = 20\n") && t.contains("  seed = 2\n}"),
            "{t}"
        );
        let t = set(&["optimizer=sgd", "optimizer.lr=0.5"]).expect("applies");
        assert!(t.contains("optimizer = sgd(lr = 0.5)"), "{t}");
    }

    #[test]
    fn refusals_name_the_set_and_what_it_can_be() {
        let e = set(&["optimiser.lr=1"]).expect_err("refused");
        assert!(
            e.contains("`optimiser` is not a setting") && e.contains("optimizer"),
            "{e}"
        );
        assert!(e.contains("the settings are: data, batch"), "{e}");
        let e = set(&["seed"]).expect_err("refused");
        assert!(e.contains("give KEY=VALUE"), "{e}");
        let e = set(&["lr_schedule.warmup=3"]).expect_err("refused");
        assert!(e.contains("sets no `lr_schedule`"), "{e}");
        let e = set(&["batch.x=3"]).expect_err("refused");
        assert!(
            e.contains("`batch` is `4`, which takes no arguments"),
            "{e}"
        );
        let e = set(&["seed=(2"]).expect_err("refused");
        assert!(e.starts_with("--set seed=(2: `(2`:"), "{e}");
    }
}
