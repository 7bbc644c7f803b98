//! Calls with arguments: signatures, binding written arguments (positional, then
//! `name = value`) to parameters, and reading literal arguments (integers, numbers,
//! booleans, integer lists). Shared by ops, initialisers, data sources and optimizers.

use super::ast::{Arg, Expr, ExprKind, Ident, Span};
use super::error::{backticked, did_you_mean, Diag};

type R<T> = Result<T, Diag>;

/// The parameters of something callable, in positional order.
pub(crate) struct Sig {
    /// What it is called.
    pub name: &'static str,
    /// `(parameter, required)`.
    pub params: &'static [(&'static str, bool)],
    /// The usage line shown in help, e.g. `softmax(x, axis = -1)`.
    pub usage: &'static str,
}

/// What [`bind`] needs to know of something callable: a [`Sig`], or a table entry
/// that says more of its parameters (the model ops of `lower.rs`).
pub(crate) trait Signature {
    /// What it is called.
    fn name(&self) -> &'static str;
    /// `(parameter, required)`, in positional order.
    fn params(&self) -> Vec<(&'static str, bool)>;
    /// The usage line shown in help.
    fn usage(&self) -> &'static str;
}

impl Signature for Sig {
    fn name(&self) -> &'static str {
        self.name
    }
    fn params(&self) -> Vec<(&'static str, bool)> {
        self.params.to_vec()
    }
    fn usage(&self) -> &'static str {
        self.usage
    }
}

/// Matches `args` to the parameters of `sig`; the result has one slot per parameter.
/// `what` names the callable in messages ("op", "initialiser", ...).
pub(crate) fn bind<'a>(
    sig: &impl Signature,
    what: &str,
    call: Span,
    args: &'a [Arg],
) -> R<Vec<Option<&'a Arg>>> {
    let params = sig.params();
    let mut slots: Vec<Option<&Arg>> = vec![None; params.len()];
    let usage = format!("usage: {}", sig.usage());
    let mut seen_keyword = false;
    let mut positional = 0;
    for arg in args {
        match &arg.name {
            None => {
                if seen_keyword {
                    return Err(Diag::new(
                        arg.span,
                        "a positional argument cannot follow a keyword argument",
                        "positional argument after `name = value`",
                    )
                    .help(usage));
                }
                if positional >= params.len() {
                    let n = params.len();
                    let given = args.iter().filter(|a| a.name.is_none()).count();
                    let last = args
                        .iter()
                        .rev()
                        .find(|a| a.name.is_none())
                        .map_or(arg.span, |a| a.span);
                    return Err(Diag::new(
                        arg.span.to(last),
                        format!(
                            "{what} `{}` takes {n} argument{}, but {given} were given",
                            sig.name(),
                            if n == 1 { "" } else { "s" }
                        ),
                        if given - n == 1 {
                            "unexpected argument"
                        } else {
                            "unexpected arguments"
                        },
                    )
                    .help(usage));
                }
                slots[positional] = Some(arg);
                positional += 1;
            }
            Some(key) => {
                seen_keyword = true;
                let Some(i) = params.iter().position(|(p, _)| *p == key.name) else {
                    return Err(unknown_keyword(sig, what, key));
                };
                if slots[i].is_some() {
                    return Err(Diag::new(
                        key.span,
                        format!("argument `{}` of `{}` is given twice", key.name, sig.name()),
                        "given again here",
                    )
                    .help(usage));
                }
                slots[i] = Some(arg);
            }
        }
    }
    for (i, (p, required)) in params.iter().enumerate() {
        if *required && slots[i].is_none() {
            return Err(Diag::new(
                call,
                format!("{what} `{}` is missing its argument `{p}`", sig.name()),
                format!("`{p}` is needed"),
            )
            .help(usage));
        }
    }
    Ok(slots)
}

fn unknown_keyword(sig: &impl Signature, what: &str, key: &Ident) -> Diag {
    let names: Vec<&str> = sig.params().iter().map(|(p, _)| *p).collect();
    let help = match did_you_mean(&key.name, names.iter().copied()) {
        Some(s) => format!("{s} (usage: {})", sig.usage()),
        None if names.is_empty() => format!("`{}` takes no arguments", sig.name()),
        None => format!("its arguments are {}", backticked(&names, "and")),
    };
    Diag::new(
        key.span,
        format!("{what} `{}` has no argument `{}`", sig.name(), key.name),
        "unknown argument",
    )
    .help(help)
}

/// A literal value as written: `3`, `-1`, `0.5`, `-1e-3` (unary minus on a number).
fn literal(e: &Expr) -> Option<(bool, &str)> {
    match &e.kind {
        ExprKind::Number(s) => Some((false, s)),
        ExprKind::Neg(inner) => match &inner.kind {
            ExprKind::Number(s) => Some((true, s)),
            _ => None,
        },
        _ => None,
    }
}

/// What an expression is, for "expected X, found Y".
pub(crate) fn describe(e: &Expr) -> String {
    match &e.kind {
        ExprKind::Number(s) => format!("the number {s}"),
        ExprKind::Neg(_) if literal(e).is_some() => "a negative number".into(),
        ExprKind::Name(n) => format!("`{n}`"),
        ExprKind::Str(t) => format!("the string \"{t}\""),
        ExprKind::Call { name, .. } => format!("a call to `{}`", name.name),
        ExprKind::List(_) => "a list".into(),
        ExprKind::Binary { .. } | ExprKind::Neg(_) => "an expression".into(),
    }
}

/// A string literal (a data file's path), not empty.
pub(crate) fn string(e: &Expr, what: &str) -> R<String> {
    match &e.kind {
        ExprKind::Str(t) if !t.trim().is_empty() => Ok(t.clone()),
        ExprKind::Str(_) => Err(Diag::new(e.span, format!("{what} is empty"), "empty")),
        _ => Err(Diag::new(
            e.span,
            format!("{what} must be a string, found {}", describe(e)),
            "expected a string in double quotes",
        )),
    }
}

/// A whole number (possibly negative) written as a literal.
pub(crate) fn int(e: &Expr, what: &str) -> R<i64> {
    let Some((neg, text)) = literal(e) else {
        return Err(Diag::new(
            e.span,
            format!("{what} must be a whole number, found {}", describe(e)),
            "expected a whole number",
        ));
    };
    if text.contains(['.', 'e', 'E']) {
        return Err(Diag::new(
            e.span,
            format!("{what} must be a whole number, found `{text}`"),
            "expected a whole number",
        ));
    }
    let Ok(v) = text.parse::<i64>() else {
        return Err(Diag::new(
            e.span,
            format!("the number `{text}` is too large"),
            "too large",
        )
        .help(format!("{what} must be at most {}", i64::MAX)));
    };
    Ok(if neg { -v } else { v })
}

/// A whole number at least `min`.
pub(crate) fn uint(e: &Expr, what: &str, min: u64) -> R<u64> {
    let v = match literal(e) {
        // Parsed as u64 so that seeds up to u64::MAX are accepted.
        Some((false, text)) if !text.contains(['.', 'e', 'E']) => {
            text.parse::<u64>().map_err(|_| {
                Diag::new(
                    e.span,
                    format!("the number `{text}` is too large"),
                    "too large",
                )
                .help(format!("{what} must be at most {}", u64::MAX))
            })?
        }
        _ => {
            let v = int(e, what)?;
            u64::try_from(v).map_err(|_| {
                Diag::new(
                    e.span,
                    format!("{what} must be {}, found {v}", at_least(min)),
                    "negative",
                )
            })?
        }
    };
    check_min(e, what, v, min)
}

fn at_least(min: u64) -> String {
    match min {
        0 => "zero or more".into(),
        1 => "at least 1".into(),
        m => format!("at least {m}"),
    }
}

fn check_min(e: &Expr, what: &str, v: u64, min: u64) -> R<u64> {
    if v < min {
        return Err(Diag::new(
            e.span,
            format!("{what} must be {}, found {v}", at_least(min)),
            "too small",
        ));
    }
    Ok(v)
}

/// A whole number at least `min`, as a `usize`.
pub(crate) fn usize_(e: &Expr, what: &str, min: u64) -> R<usize> {
    let v = uint(e, what, min)?;
    usize::try_from(v).map_err(|_| Diag::new(e.span, format!("{what} is too large"), "too large"))
}

/// A finite number written as a literal.
pub(crate) fn float(e: &Expr, what: &str) -> R<f64> {
    let Some((neg, text)) = literal(e) else {
        return Err(Diag::new(
            e.span,
            format!("{what} must be a number, found {}", describe(e)),
            "expected a number",
        ));
    };
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(if neg { -v } else { v }),
        _ => Err(Diag::new(
            e.span,
            format!("the number `{text}` is too large"),
            "too large",
        )),
    }
}

/// `true` or `false`.
pub(crate) fn boolean(e: &Expr, what: &str) -> R<bool> {
    match &e.kind {
        ExprKind::Name(n) if n == "true" => Ok(true),
        ExprKind::Name(n) if n == "false" => Ok(false),
        _ => Err(Diag::new(
            e.span,
            format!("{what} must be `true` or `false`, found {}", describe(e)),
            "expected `true` or `false`",
        )),
    }
}

/// `[1, -1, ...]`: whole numbers in a list.
pub(crate) fn int_list(e: &Expr, what: &str) -> R<Vec<(i64, Span)>> {
    match &e.kind {
        ExprKind::List(items) => items
            .iter()
            .map(|i| int(i, &format!("each of {what}")).map(|v| (v, i.span)))
            .collect(),
        _ => Err(Diag::new(
            e.span,
            format!(
                "{what} must be a list such as `[0, 1]`, found {}",
                describe(e)
            ),
            "expected a list",
        )),
    }
}
