//! The text IR parser: the inverse of [`crate::print()`].

use crate::attrs::{op_from_parts, AttrValue};
use crate::graph::{Graph, NodeId, ValueId};
use crate::op::Init;
use crate::types::{DType, Shape, TensorType, ValueType};
use pest::iterators::Pair;
use pest::Parser;
use std::collections::HashMap;
use thiserror::Error;

mod grammar {
    #![allow(missing_docs)]
    #[derive(pest_derive::Parser)]
    #[grammar = "text.pest"]
    pub struct TextParser;
}
use grammar::{Rule, TextParser};

/// Text that is not valid IR, located by line and column.
#[derive(Clone, Debug, PartialEq, Error)]
#[error("{line}:{col}: {message}")]
pub struct ParseError {
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub col: usize,
    /// What is wrong.
    pub message: String,
}

fn at(pair: &Pair<Rule>, message: impl Into<String>) -> ParseError {
    let (line, col) = pair.as_span().start_pos().line_col();
    ParseError {
        line,
        col,
        message: message.into(),
    }
}

/// Parses text IR into a graph. The result types written in the text are kept as
/// they are; run [`crate::verify()`] to check them against the shape rules.
pub fn parse(text: &str) -> Result<Graph, ParseError> {
    let mut pairs = TextParser::parse(Rule::file, text).map_err(|e| {
        let e = e.renamed_rules(rule_words);
        let (line, col) = match e.line_col {
            pest::error::LineColLocation::Pos(p) | pest::error::LineColLocation::Span(p, _) => p,
        };
        ParseError {
            line,
            col,
            message: e.variant.message().to_string(),
        }
    })?;
    let file = pairs.next().ok_or_else(|| ParseError {
        line: 1,
        col: 1,
        message: "empty input".into(),
    })?;
    let mut inner = file.into_inner();
    let name = inner
        .next()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let mut g = Graph::new(name);
    let mut defs: HashMap<u64, NodeId> = HashMap::new();
    for stmt in inner {
        if stmt.as_rule() != Rule::stmt {
            continue;
        }
        let mut def = None;
        let mut mnemonic = None;
        let mut attrs = Vec::new();
        let mut operands = Vec::new();
        let mut results = Vec::new();
        let mut op_pair = None;
        for p in stmt.clone().into_inner() {
            match p.as_rule() {
                Rule::def => def = Some((number(&p, &p.as_str()[1..])?, p.clone())),
                Rule::ident => {
                    mnemonic = Some(p.as_str().to_string());
                    op_pair = Some(p);
                }
                Rule::attrs => {
                    for a in p.into_inner() {
                        let mut kv = a.into_inner();
                        let (Some(k), Some(v)) = (kv.next(), kv.next()) else {
                            continue;
                        };
                        attrs.push((k.as_str().to_string(), attr_value(v)?));
                    }
                }
                Rule::operands => {
                    for v in p.into_inner() {
                        let text = &v.as_str()[1..];
                        let (n, port) = match text.split_once('#') {
                            Some((n, port)) => (n, number(&v, port)?),
                            None => (text, 0),
                        };
                        let n = number(&v, n)?;
                        let node = *defs
                            .get(&n)
                            .ok_or_else(|| at(&v, format!("%{n} is used before it is defined")))?;
                        let port = u16::try_from(port).map_err(|_| at(&v, "port out of range"))?;
                        let value = ValueId { node, port };
                        if g.try_value_type(value).is_none() {
                            return Err(at(&v, format!("%{n} has no output {port}")));
                        }
                        operands.push(value);
                    }
                }
                Rule::results => {
                    for t in p.into_inner() {
                        results.push(value_type(t)?);
                    }
                }
                _ => {}
            }
        }
        let (Some(mnemonic), Some(op_pair)) = (mnemonic, op_pair) else {
            return Err(at(&stmt, "expected an op"));
        };
        let op = op_from_parts(&mnemonic, attrs, &results).map_err(|m| at(&op_pair, m))?;
        if op.is_sink() != def.is_none() {
            return Err(at(
                &stmt,
                if op.is_sink() {
                    format!("`{mnemonic}` has no result to name")
                } else {
                    format!("`{mnemonic}` needs a result: `%N = {mnemonic} ...`")
                },
            ));
        }
        let id = g.add_typed(op, operands, results);
        if let Some((n, p)) = def {
            if defs.insert(n, id).is_some() {
                return Err(at(&p, format!("%{n} is defined twice")));
            }
        }
    }
    Ok(g)
}

fn number(p: &Pair<Rule>, s: &str) -> Result<u64, ParseError> {
    s.parse()
        .map_err(|_| at(p, format!("`{s}` is not a valid number")))
}

fn int(p: &Pair<Rule>) -> Result<i64, ParseError> {
    p.as_str()
        .parse()
        .map_err(|_| at(p, format!("`{}` is not a valid integer", p.as_str())))
}

fn float(p: &Pair<Rule>) -> Result<f64, ParseError> {
    p.as_str()
        .parse()
        .map_err(|_| at(p, format!("`{}` is not a valid number", p.as_str())))
}

fn attr_value(p: Pair<Rule>) -> Result<AttrValue, ParseError> {
    Ok(match p.as_rule() {
        Rule::int => AttrValue::Int(int(&p)?),
        Rule::float => AttrValue::Float(float(&p)?),
        Rule::bool => AttrValue::Bool(p.as_str() == "true"),
        Rule::string => {
            let s = p.as_str();
            let body = &s[1..s.len() - 1];
            AttrValue::Str(body.replace("\\\"", "\"").replace("\\\\", "\\"))
        }
        Rule::list => AttrValue::List(p.into_inner().map(|x| int(&x)).collect::<Result<_, _>>()?),
        Rule::tensor_type => AttrValue::Type(tensor_type(p)?),
        Rule::init => {
            let mut it = p.clone().into_inner();
            let head = it.next().ok_or_else(|| at(&p, "expected an initialiser"))?;
            let init = match head.as_str() {
                "zeros" => Init::Zeros,
                "ones" => Init::Ones,
                "glorot" => Init::Glorot,
                "he" => Init::He,
                f => {
                    let a = it.next().ok_or_else(|| at(&p, "expected two numbers"))?;
                    let b = it.next().ok_or_else(|| at(&p, "expected two numbers"))?;
                    let (a, b) = (float(&a)?, float(&b)?);
                    if f == "normal" {
                        Init::Normal { mean: a, std: b }
                    } else {
                        Init::Uniform { lo: a, hi: b }
                    }
                }
            };
            AttrValue::Init(init)
        }
        _ => return Err(at(&p, "unexpected attribute value")),
    })
}

fn tensor_type(p: Pair<Rule>) -> Result<TensorType, ParseError> {
    let mut it = p.clone().into_inner();
    let (Some(dt), Some(dims)) = (it.next(), it.next()) else {
        return Err(at(&p, "expected a tensor type"));
    };
    let dtype = DType::from_name(dt.as_str()).ok_or_else(|| at(&dt, "unknown dtype"))?;
    let dims = dims
        .into_inner()
        .map(|d| {
            let v = int(&d)?;
            usize::try_from(v).map_err(|_| at(&d, "dimensions are non-negative"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Shape::check_size(&dims).map_err(|e| at(&p, &e))?;
    Ok(TensorType {
        dtype,
        shape: Shape(dims),
    })
}

fn value_type(p: Pair<Rule>) -> Result<ValueType, ParseError> {
    match p.as_rule() {
        Rule::tensor_type => Ok(ValueType::Tensor(tensor_type(p)?)),
        Rule::slices_type => {
            let mut it = p.clone().into_inner();
            let (Some(t), Some(n)) = (it.next(), it.next()) else {
                return Err(at(&p, "expected indexed_slices(TYPE, nnz=N)"));
            };
            let nnz = usize::try_from(int(&n)?).map_err(|_| at(&n, "nnz is non-negative"))?;
            let dense = tensor_type(t)?;
            // The rows carried, as one tensor: `nnz` rows of the dense type's row.
            let rows: Vec<usize> = std::iter::once(nnz)
                .chain(dense.dims().iter().skip(1).copied())
                .collect();
            Shape::check_size(&rows).map_err(|e| at(&n, &e))?;
            Ok(ValueType::IndexedSlices { dense, nnz })
        }
        _ => Err(at(&p, "expected a type")),
    }
}

/// Rules as a reader of the text IR would name them.
fn rule_words(r: &Rule) -> String {
    match r {
        Rule::dims => "a shape like [2,3]",
        Rule::def => "a result like %3",
        Rule::value | Rule::operands => "an operand like %3",
        Rule::ident => "an op name",
        Rule::attrs | Rule::attr => "attributes like {axis=1}",
        Rule::results | Rule::tensor_type | Rule::slices_type => "a type like f32[2,3]",
        Rule::stmt => "a statement",
        Rule::EOI => "the end of the input",
        other => return format!("{other:?}"),
    }
    .to_string()
}
