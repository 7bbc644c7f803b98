//! Source text to [`ast::File`](super::ast::File): the pest parser over
//! `grammar.pest`, syntax errors in words, and the tree built from pest's pairs.

use super::ast::*;
use super::error::{floor_boundary, Diag};
use pest::error::{ErrorVariant, InputLocation};
use pest::iterators::Pair;
use pest::Parser as _;
use std::collections::BTreeSet;

#[derive(pest_derive::Parser)]
#[grammar = "dsl/grammar.pest"]
struct DslParser;

/// The deepest nesting of brackets accepted. Deeper input is refused before parsing
/// so that neither the parser nor the lowering recurses without bound.
const MAX_NESTING: usize = 64;
/// The deepest expression tree accepted (a chain `a + b + ...` of n operators is n
/// deep): the lowering recurses over the tree.
const MAX_DEPTH: usize = 200;

type R<T> = Result<T, Diag>;

/// Parses a whole file.
pub(crate) fn parse(src: &str) -> R<File> {
    check_nesting(src)?;
    if src.trim().is_empty() {
        return Err(Diag::new(
            Span::new(0, src.len()),
            "the file is empty",
            "expected a `model` block and a `train` block",
        )
        .help("a program is `model name { ... }` followed by `train { ... }`"));
    }
    pest::set_error_detail(true);
    let mut pairs = DslParser::parse(Rule::file, src).map_err(|e| {
        let d = syntax_error(src, &e);
        // A block left open is reported at the block, not where the parser gave up.
        match unclosed_block(src) {
            Some((at, block)) if at <= d.span.start => block,
            _ => d,
        }
    })?;
    let file = pairs
        .next()
        .ok_or_else(|| Diag::new(Span::new(0, 0), "empty parse", ""))?;
    build_file(file)
}

/// Whether `text` is one whole expression (a `--set` value), or what is wrong with it.
pub(crate) fn check_expression(text: &str) -> Result<(), String> {
    check_nesting(text).map_err(|d| d.message)?;
    let pairs = DslParser::parse(Rule::expr, text).map_err(|e| syntax_error(text, &e).message)?;
    let end = pairs.last().map_or(0, |p| p.as_span().end());
    if text[end..].trim().is_empty() {
        Ok(())
    } else {
        Err(format!("`{}` follows the value", text[end..].trim()))
    }
}

/// Refuses brackets nested deeper than [`MAX_NESTING`] (comments skipped).
fn check_nesting(src: &str) -> R<()> {
    let mut depth = 0usize;
    let mut in_comment = false;
    let mut prev = '\0';
    for (i, c) in src.char_indices() {
        if in_comment {
            in_comment = c != '\n';
        } else if c == '#' || (c == '/' && prev == '/') {
            in_comment = true;
        } else if c == '(' || c == '[' || c == '{' {
            depth += 1;
            if depth > MAX_NESTING {
                return Err(Diag::new(
                    Span::new(i, i + 1),
                    format!("brackets are nested more than {MAX_NESTING} deep"),
                    "too deep",
                )
                .help("name intermediate results with `name = expression`"));
            }
        } else if c == ')' || c == ']' || c == '}' {
            depth = depth.saturating_sub(1);
        }
        prev = c;
    }
    Ok(())
}

// ---------------------------------------------------------------- syntax errors

/// Finds a `{` not closed before the next top-level keyword (`model` or `train` at the
/// start of a line) or the end of the file. Returns where that became clear and the
/// diagnostic, pointing at the block's header.
fn unclosed_block(src: &str) -> Option<(usize, Diag)> {
    let mut open: Vec<usize> = Vec::new();
    let mut in_comment = false;
    let mut line_start = true;
    for (i, c) in src.char_indices() {
        if c == '\n' {
            in_comment = false;
            line_start = true;
            continue;
        }
        if in_comment || c.is_whitespace() {
            continue;
        }
        if c == '#' || src[i..].starts_with("//") {
            in_comment = true;
            continue;
        }
        if line_start && !open.is_empty() {
            let rest = &src[i..];
            for kw in ["model", "train"] {
                let Some(after) = rest.strip_prefix(kw) else {
                    continue;
                };
                let whole = after
                    .chars()
                    .next()
                    .is_none_or(|a| !(a.is_ascii_alphanumeric() || a == '_'));
                if whole && !after.trim_start().starts_with('=') {
                    let line = super::error::line_of(src, i);
                    let block = open_block(src, open[open.len() - 1])
                        .help(format!("add `}}` before `{kw}` on line {line}"));
                    return Some((i, block));
                }
            }
        }
        line_start = false;
        match c {
            '{' => open.push(i),
            '}' => {
                open.pop();
            }
            _ => {}
        }
    }
    let last = *open.last()?;
    Some((
        src.trim_end().len(),
        open_block(src, last).help("add `}` at the end of the block"),
    ))
}

/// "this block is not closed", underlining its header (`model mlp {`).
fn open_block(src: &str, brace: usize) -> Diag {
    let line_start = src[..brace].rfind('\n').map_or(0, |i| i + 1);
    let header = src[line_start..brace].trim();
    let start = brace - src[line_start..brace].trim_start().len();
    let what = if header.is_empty() {
        "this block".to_string()
    } else {
        format!("the `{header}` block")
    };
    Diag::new(
        Span::new(start, brace + 1),
        format!("{what} is not closed"),
        "this block has no closing `}`",
    )
}

/// What the parser wanted, in words, ordered for the message.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Want {
    Statement,
    TrainEntry,
    Expression,
    Type,
    Dim,
    Init,
    Name,
    Number,
    Argument,
    Token(String),
    Operator,
    Block,
    End,
}

impl Want {
    fn words(&self) -> String {
        match self {
            Want::Statement => "a statement (`input`, `param`, `name = ...` or `minimize`)".into(),
            Want::TrainEntry => "a setting such as `batch = 64`".into(),
            Want::Expression => "an expression".into(),
            Want::Type => "a type such as `f32[B, 784]`".into(),
            Want::Dim => "a dimension (a number or `B`)".into(),
            Want::Init => "an initialiser (zeros, ones, normal, uniform, glorot or he)".into(),
            Want::Name => "a name".into(),
            Want::Number => "a number".into(),
            Want::Argument => "an argument".into(),
            Want::Token(t) => format!("`{t}`"),
            Want::Operator => "an operator".into(),
            Want::Block => "a `model` or `train` block".into(),
            Want::End => "the end of the file".into(),
        }
    }
}

fn want_of_rule(rule: Rule) -> Option<Want> {
    Some(match rule {
        Rule::expr
        | Rule::product
        | Rule::matprod
        | Rule::unary
        | Rule::paren
        | Rule::call
        | Rule::list
        | Rule::neg_op => Want::Expression,
        Rule::number => Want::Number,
        Rule::string => Want::Expression,
        Rule::ident => Want::Name,
        Rule::tensor_type => Want::Type,
        Rule::dim => Want::Dim,
        Rule::init => Want::Init,
        Rule::input_decl
        | Rule::param_decl
        | Rule::minimize
        | Rule::let_stmt
        | Rule::stage_mark
        | Rule::shard_mark
        | Rule::kw_frozen
        | Rule::kw_shard
        | Rule::kw_input
        | Rule::kw_param
        | Rule::kw_stage
        | Rule::kw_minimize => Want::Statement,
        Rule::train_entry => Want::TrainEntry,
        Rule::model | Rule::train | Rule::kw_model | Rule::kw_train => Want::Block,
        Rule::add_op | Rule::mul_op | Rule::matmul_op => Want::Operator,
        Rule::args => Want::Token("(".into()),
        Rule::arg => Want::Argument,
        Rule::EOI => Want::End,
        _ => return None,
    })
}

/// A token the parser tried, as pest prints it (`ParsingToken` is not exported):
/// literal strings as themselves, character ranges as `a..z`, builtins as
/// `BUILTIN_RULE`. Blanks and comment starters (tried everywhere) are dropped.
fn want_of_token(token: &str) -> Option<Want> {
    Some(match token {
        "BUILTIN_RULE" | "#" | "//" => return None,
        t if t.trim().is_empty() => return None,
        "a..z" | "A..Z" | "_" => Want::Name,
        "0..9" => Want::Number,
        t if t.len() > 2 && t.contains("..") => return None,
        "+" | "-" | "*" | "/" | "@" => Want::Operator,
        "model" | "train" => Want::Block,
        "input" | "param" | "minimize" | "pipeline_stage" => Want::Statement,
        "e" | "E" | "." => Want::Number,
        t => Want::Token(t.to_string()),
    })
}

/// Where the last string opened on `line` (outside comments) is, if it is not closed.
fn unclosed_quote(line: &str) -> Option<usize> {
    let code = line.split('#').next().unwrap_or("");
    let mut open = None;
    for (i, c) in code.char_indices() {
        if c == '"' {
            open = if open.is_some() { None } else { Some(i) };
        }
    }
    open
}

/// A pest failure as a diagnostic: "expected X or Y, found Z".
///
/// pest reports the furthest position where a *rule* failed, with those rules; with
/// error detail on it also records the furthest position where a *token* failed, with
/// the tokens. The furthest of the two is where the mistake is.
fn syntax_error(src: &str, e: &pest::error::Error<Rule>) -> Diag {
    let rule_pos = match e.location {
        InputLocation::Pos(p) => p,
        InputLocation::Span((s, _)) => s,
    };
    let attempts = e.parse_attempts();
    let pos = attempts
        .as_ref()
        .map_or(rule_pos, |a| a.max_position.max(rule_pos));
    let pos = floor_boundary(src, pos);
    // A string left open runs to the end of its line, where nothing can follow it.
    let line_start = src[..pos].rfind('\n').map_or(0, |i| i + 1);
    if let Some(open) = unclosed_quote(&src[line_start..pos]) {
        let at = line_start + open;
        return Diag::new(
            Span::new(at, at + 1),
            "this string is not closed",
            "opened here",
        )
        .help("a string ends with `\"` on the line where it starts");
    }
    let mut wants = BTreeSet::new();
    match &e.variant {
        ErrorVariant::ParsingError { positives, .. } => {
            if rule_pos == pos {
                wants.extend(positives.iter().filter_map(|r| want_of_rule(*r)));
            }
        }
        ErrorVariant::CustomError { message } => {
            return Diag::new(
                Span::new(pos, pos),
                format!("cannot parse: {message}"),
                "here",
            );
        }
    }
    if let Some(a) = &attempts {
        if a.max_position == pos {
            let tokens: Vec<String> = a.expected_tokens().iter().map(|t| t.to_string()).collect();
            wants.extend(tokens.iter().filter_map(|t| want_of_token(t)));
            // A name, `(`, `[` and `-` together: the start of an expression.
            let starts = ["(", "["].iter().all(|t| tokens.iter().any(|x| x == t));
            if starts && wants.contains(&Want::Name) {
                wants.insert(Want::Expression);
            }
        }
    }
    // Right after a name or a number, pest also tried to make it longer: not a mistake.
    let glued = src[..pos]
        .chars()
        .next_back()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if glued
        && wants
            .iter()
            .any(|w| !matches!(w, Want::Name | Want::Number))
    {
        wants.remove(&Want::Name);
        wants.remove(&Want::Number);
    }
    // After `name:` a name starts the type.
    if previous_code_end(src, pos).is_some_and(|end| src[..end].ends_with(':'))
        && wants.remove(&Want::Name)
    {
        wants.insert(Want::Type);
    }
    simplify(&mut wants);
    if let Some(d) = dangling(src, pos) {
        return d;
    }
    let list: Vec<String> = wants.iter().map(Want::words).collect();
    let expected = match list.len() {
        0 => "something else".to_string(),
        1 => list[0].clone(),
        n => format!("{} or {}", list[..n - 1].join(", "), list[n - 1]),
    };
    let (found, mut span) = found_at(src, pos);
    // When the surprise is on a later line, what is missing belongs at the end of the
    // previous one: point there, as rustc does.
    let extraneous = [Want::Statement, Want::TrainEntry, Want::Block, Want::End]
        .iter()
        .any(|w| wants.contains(w));
    if let Some(end) = previous_code_end(src, pos).filter(|_| !extraneous) {
        if src[end..pos].contains('\n') {
            span = Span::new(end, end);
        }
    }
    if (found == "`)`" || found == "`]`") && extraneous {
        return Diag::new(
            span,
            format!("unexpected {found}: it closes no bracket"),
            "unmatched",
        );
    }
    let mut d = Diag::new(
        span,
        format!("expected {expected}, found {found}"),
        format!("expected {expected}"),
    );
    if wants.contains(&Want::Token("}".into())) && found == "the end of the file" {
        d = d.help("a block is not closed: add `}`");
    }
    d
}

/// The end of the code (comments and blanks skipped) before `pos`, if any.
fn previous_code_end(src: &str, pos: usize) -> Option<usize> {
    let mut end = pos;
    loop {
        let line_start = src[..end].rfind('\n').map_or(0, |i| i + 1);
        let line = &src[line_start..end];
        let code = match (line.find('#'), line.find("//")) {
            (Some(a), Some(b)) => &line[..a.min(b)],
            (Some(a), None) | (None, Some(a)) => &line[..a],
            (None, None) => line,
        };
        let code = code.trim_end();
        if !code.is_empty() {
            return Some(line_start + code.len());
        }
        if line_start == 0 {
            return None;
        }
        end = line_start - 1;
    }
}

/// `name =` with nothing after it on its line: the parser then read the next line as
/// the value and failed there. Say what really happened.
fn dangling(src: &str, pos: usize) -> Option<Diag> {
    // The line of `pos` and the code line before it.
    let line_start = src[..pos].rfind('\n').map_or(0, |i| i + 1);
    if line_start == 0 {
        return None;
    }
    let end = previous_code_end(src, line_start - 1)?;
    if !src[..end].ends_with('=') {
        return None;
    }
    Some(
        Diag::new(
            Span::new(end - 1, end),
            "expected a value after `=`, found the end of the line",
            "nothing after `=`",
        )
        .help("write the value on the same line as its `=`"),
    )
}

/// Drops expectations implied by others, so the message names what matters.
fn simplify(wants: &mut BTreeSet<Want>) {
    if wants.contains(&Want::Expression) {
        // Tokens and rules that only start an expression.
        for t in ["(", "[", "\""] {
            wants.remove(&Want::Token(t.into()));
        }
        wants.remove(&Want::Name);
        wants.remove(&Want::Number);
        wants.remove(&Want::Argument);
    }
    if wants.contains(&Want::Argument) {
        wants.remove(&Want::Name);
    }
    if wants.contains(&Want::Token(")".into())) || wants.contains(&Want::Token(",".into())) {
        // `=` of a keyword argument: possible after any name, rarely what is missing.
        wants.remove(&Want::Token("=".into()));
    }
    if wants.contains(&Want::Statement) || wants.contains(&Want::TrainEntry) {
        wants.remove(&Want::Name);
    }
    if wants.contains(&Want::Dim) {
        wants.remove(&Want::Name);
        wants.remove(&Want::Number);
    }
    if wants.contains(&Want::Init) || wants.contains(&Want::Type) {
        wants.remove(&Want::Name);
    }
    // After a complete operand an operator is always possible; say so only when nothing
    // else would do.
    if wants.len() > 1 {
        wants.remove(&Want::Operator);
        if wants.len() > 1 && wants.contains(&Want::Token("(".into())) {
            // `(` after a name (a call) is as noisy as an operator.
            wants.remove(&Want::Token("(".into()));
        }
    }
    if wants.len() > 1 {
        // A number can always go on with a fraction or an exponent.
        wants.remove(&Want::Number);
    }
}

/// What is at `pos`, in words, and the span to underline.
fn found_at(src: &str, pos: usize) -> (String, Span) {
    let rest = &src[pos..];
    let Some(c) = rest.chars().next() else {
        // Point just after the last thing written rather than at trailing blank lines.
        let end = src.trim_end().len();
        return ("the end of the file".into(), Span::new(end, end));
    };
    if c.is_ascii_alphanumeric() || c == '_' {
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
            .unwrap_or(rest.len());
        let word = &rest[..len];
        return (format!("`{word}`"), Span::new(pos, pos + len));
    }
    let shown = if c.is_control() || c.is_whitespace() {
        format!("the character U+{:04X}", u32::from(c))
    } else {
        format!("`{c}`")
    };
    (shown, Span::new(pos, pos + c.len_utf8()))
}

// ---------------------------------------------------------------- pairs to tree

fn span(p: &Pair<'_, Rule>) -> Span {
    p.as_span().into()
}

fn ident(p: Pair<'_, Rule>) -> Ident {
    Ident {
        name: p.as_str().to_string(),
        span: span(&p),
    }
}

/// A structural surprise: the tree does not have the shape the grammar promises.
fn internal(at: Span, what: &str) -> Diag {
    Diag::new(
        at,
        format!("internal error in the DSL parser: {what}"),
        "here",
    )
}

fn next<'i>(it: &mut pest::iterators::Pairs<'i, Rule>, at: Span, what: &str) -> R<Pair<'i, Rule>> {
    it.next().ok_or_else(|| internal(at, what))
}

fn build_file(p: Pair<'_, Rule>) -> R<File> {
    let mut file = File {
        models: Vec::new(),
        trains: Vec::new(),
    };
    for item in p.into_inner() {
        match item.as_rule() {
            Rule::model => file.models.push(build_model(item)?),
            Rule::train => file.trains.push(build_train(item)?),
            _ => {}
        }
    }
    Ok(file)
}

fn build_model(p: Pair<'_, Rule>) -> R<Model> {
    let at = span(&p);
    let close = Span::new(at.end.saturating_sub(1), at.end);
    let mut it = p.into_inner();
    let kw = next(&mut it, at, "model keyword")?;
    let name = ident(next(&mut it, at, "model name")?);
    let header = span(&kw).to(name.span);
    let mut stmts = Vec::new();
    for s in it {
        stmts.push(build_stmt(s)?);
    }
    Ok(Model {
        name,
        stmts,
        header,
        close,
    })
}

fn build_stmt(p: Pair<'_, Rule>) -> R<Stmt> {
    let at = span(&p);
    let rule = p.as_rule();
    let mut it = p.into_inner();
    match rule {
        Rule::input_decl => {
            next(&mut it, at, "keyword")?;
            let name = ident(next(&mut it, at, "input name")?);
            let ty = build_type(next(&mut it, at, "input type")?)?;
            Ok(Stmt::Input { name, ty, span: at })
        }
        Rule::param_decl => {
            next(&mut it, at, "keyword")?;
            let name = ident(next(&mut it, at, "param name")?);
            let ty = build_type(next(&mut it, at, "param type")?)?;
            let init = build_init(next(&mut it, at, "initialiser")?)?;
            let (mut shard, mut frozen) = (None, false);
            for mark in it.by_ref() {
                if mark.as_rule() == Rule::kw_frozen {
                    frozen = true;
                    continue;
                }
                let span = span(&mark);
                let number = mark
                    .into_inner()
                    .find(|p| p.as_rule() == Rule::number)
                    .ok_or_else(|| Diag::new(span, "`shard` needs a dimension", "here"))?;
                let dim = number.as_str().parse::<usize>().map_err(|_| {
                    Diag::new(
                        span,
                        format!(
                            "`shard({})`: a dimension is a whole number 0, 1, ...",
                            number.as_str()
                        ),
                        "not a dimension",
                    )
                })?;
                shard = Some((dim, span));
            }
            Ok(Stmt::Param {
                name,
                ty,
                init,
                shard,
                frozen,
                span: at,
            })
        }
        Rule::minimize => {
            next(&mut it, at, "keyword")?;
            let expr = build_expr(next(&mut it, at, "objective")?)?;
            Ok(Stmt::Minimize { expr, span: at })
        }
        Rule::stage_mark => Ok(Stmt::StageMark { span: at }),
        Rule::let_stmt => {
            let name = ident(next(&mut it, at, "name")?);
            let value = build_expr(next(&mut it, at, "value")?)?;
            Ok(Stmt::Let { name, value })
        }
        _ => Err(internal(at, "unknown statement")),
    }
}

fn build_type(p: Pair<'_, Rule>) -> R<TypeExpr> {
    let at = span(&p);
    let mut it = p.into_inner();
    let dtype = ident(next(&mut it, at, "dtype")?);
    let mut dims = Vec::new();
    for d in it {
        let ds = span(&d);
        let inner = next(&mut d.into_inner(), ds, "dimension")?;
        dims.push(match inner.as_rule() {
            Rule::number => Dim::Number(inner.as_str().to_string(), span(&inner)),
            _ => Dim::Name(ident(inner)),
        });
    }
    Ok(TypeExpr {
        dtype,
        dims,
        span: at,
    })
}

fn build_init(p: Pair<'_, Rule>) -> R<InitExpr> {
    let at = span(&p);
    let mut it = p.into_inner();
    let name = ident(next(&mut it, at, "initialiser name")?);
    let args = match it.next() {
        Some(a) => Some(build_args(a)?),
        None => None,
    };
    Ok(InitExpr {
        name,
        args,
        span: at,
    })
}

fn build_train(p: Pair<'_, Rule>) -> R<TrainBlock> {
    let at = span(&p);
    let close = Span::new(at.end.saturating_sub(1), at.end);
    let mut it = p.into_inner();
    let keyword = span(&next(&mut it, at, "train keyword")?);
    let mut entries = Vec::new();
    for e in it {
        let es = span(&e);
        let mut inner = e.into_inner();
        let key = ident(next(&mut inner, es, "key")?);
        let value = build_expr(next(&mut inner, es, "value")?)?;
        entries.push(TrainEntry { key, value });
    }
    Ok(TrainBlock {
        entries,
        keyword,
        close,
    })
}

fn build_args(p: Pair<'_, Rule>) -> R<Vec<Arg>> {
    build_args_deep(p).map(|(a, _)| a)
}

fn build_args_deep(p: Pair<'_, Rule>) -> R<(Vec<Arg>, usize)> {
    let mut args = Vec::new();
    let mut depth = 0;
    for a in p.into_inner() {
        let at = span(&a);
        let mut it = a.into_inner();
        let first = next(&mut it, at, "argument")?;
        let (name, value) = match it.next() {
            Some(value) => (Some(ident(first)), value),
            None => (None, first),
        };
        let (value, d) = build_deep(value)?;
        depth = depth.max(d);
        args.push(Arg {
            name,
            value,
            span: at,
        });
    }
    Ok((args, depth))
}

fn too_deep(at: Span) -> Diag {
    Diag::new(
        at,
        format!("this expression is nested more than {MAX_DEPTH} operations deep"),
        "too deep",
    )
    .help("name intermediate results with `name = expression`")
}

/// Any of the expression rules (`expr`, `product`, `matprod`, `unary`, or a primary).
fn build_expr(p: Pair<'_, Rule>) -> R<Expr> {
    build_deep(p).map(|(e, _)| e)
}

/// An expression and the depth of its tree, refused beyond [`MAX_DEPTH`].
fn build_deep(p: Pair<'_, Rule>) -> R<(Expr, usize)> {
    let at = span(&p);
    let (e, depth) = build_expr_kind(p)?;
    if depth > MAX_DEPTH {
        return Err(too_deep(at));
    }
    Ok((e, depth))
}

fn build_expr_kind(p: Pair<'_, Rule>) -> R<(Expr, usize)> {
    let at = span(&p);
    match p.as_rule() {
        Rule::expr | Rule::product | Rule::matprod => {
            let mut it = p.into_inner();
            let (mut lhs, mut depth) = build_deep(next(&mut it, at, "operand")?)?;
            while let Some(op) = it.next() {
                let op_span = span(&op);
                let op = match op.as_str() {
                    "+" => BinOp::Add,
                    "-" => BinOp::Sub,
                    "*" => BinOp::Mul,
                    "/" => BinOp::Div,
                    _ => BinOp::MatMul,
                };
                let (rhs, rd) = build_deep(next(&mut it, at, "operand")?)?;
                depth = depth.max(rd) + 1;
                if depth > MAX_DEPTH {
                    return Err(too_deep(at));
                }
                let span = lhs.span.to(rhs.span);
                lhs = Expr {
                    kind: ExprKind::Binary {
                        op,
                        op_span,
                        lhs: Box::new(lhs),
                        rhs: Box::new(rhs),
                    },
                    span,
                };
            }
            Ok((lhs, depth))
        }
        Rule::unary => {
            let mut negs = Vec::new();
            let mut operand = None;
            for q in p.into_inner() {
                if q.as_rule() == Rule::neg_op {
                    negs.push(span(&q));
                } else {
                    operand = Some(q);
                }
            }
            let (mut e, depth) = build_deep(operand.ok_or_else(|| internal(at, "operand"))?)?;
            let depth = depth + negs.len();
            if depth > MAX_DEPTH {
                return Err(too_deep(at));
            }
            for neg in negs.into_iter().rev() {
                let span = neg.to(e.span);
                e = Expr {
                    kind: ExprKind::Neg(Box::new(e)),
                    span,
                };
            }
            Ok((e, depth))
        }
        Rule::paren => {
            let inner = next(&mut p.into_inner(), at, "parenthesised expression")?;
            let (e, depth) = build_deep(inner)?;
            // Keep the parentheses in the span: errors then underline what was written.
            Ok((
                Expr {
                    kind: e.kind,
                    span: at,
                },
                depth,
            ))
        }
        Rule::number => Ok((
            Expr {
                kind: ExprKind::Number(p.as_str().to_string()),
                span: at,
            },
            1,
        )),
        Rule::ident => Ok((
            Expr {
                kind: ExprKind::Name(p.as_str().to_string()),
                span: at,
            },
            1,
        )),
        Rule::string => {
            let quoted = p.as_str();
            Ok((
                Expr {
                    kind: ExprKind::Str(quoted[1..quoted.len() - 1].to_string()),
                    span: at,
                },
                1,
            ))
        }
        Rule::call => {
            let mut it = p.into_inner();
            let name = ident(next(&mut it, at, "op name")?);
            let (args, depth) = build_args_deep(next(&mut it, at, "arguments")?)?;
            Ok((
                Expr {
                    kind: ExprKind::Call { name, args },
                    span: at,
                },
                depth + 1,
            ))
        }
        Rule::list => {
            let mut items = Vec::new();
            let mut depth = 0;
            for q in p.into_inner() {
                let (e, d) = build_deep(q)?;
                depth = depth.max(d);
                items.push(e);
            }
            Ok((
                Expr {
                    kind: ExprKind::List(items),
                    span: at,
                },
                depth + 1,
            ))
        }
        _ => Err(internal(at, "unknown expression")),
    }
}
