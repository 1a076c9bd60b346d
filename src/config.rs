//! Run files: `--config FILE.toml` holds a run's training options, `--print-config` writes the
//! resolved ones as such a file, and every runs.jsonl record keeps them (`config`), so that a
//! run can be repeated from its file or its record.
//!
//! A file is read through clap's own definitions of the options: each key is an option's long
//! name with `_` for `-` (sections only group; a key names one option whichever section holds
//! it), turned into that option's command-line text and parsed by clap like the command line.
//! So a new option is in run files with nothing to add here, and a file's value is checked as
//! the same flag's would be. Precedence: command line > file > `--preset` > built-in default.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, ArgMatches, Args, Command};

use crate::train::options::{run_file_key, RunConfig, TrainArgs};

/// The section of a run file that holds the options of each help heading (torchtitan-style
/// `[data]`, `[model]`, ...). An option without a heading goes to `[run]`.
const SECTIONS: &[(&str, &str)] = &[
    ("Run", "run"),
    ("Data", "data"),
    ("Model and optimizer", "model"),
    ("Exchange", "exchange"),
    ("Horovod", "horovod"),
    ("Parameter server", "ps"),
    ("Pipeline", "pipeline"),
    ("Sharding and tensor parallelism", "sharding"),
    ("Checkpoints and faults", "checkpoint"),
    ("Output", "output"),
];

/// Options that are about reading or printing run files, not about the run: never in one.
const NOT_IN_FILES: &[&str] = &["config", "print_config"];

/// Renamed options whose old name still works but warns (once, before anything starts): the
/// old name, the new one, and why it changed.
const DEPRECATED: &[(&str, &str, &str)] = &[(
    "warmup-steps",
    "skip-steps",
    "it counts the steps left out of the throughput figures; the learning-rate warm-up is --warmup-epochs",
)];

/// The warnings for the deprecated names a command line uses (up to a `--`).
pub fn deprecated_names(argv: &[OsString]) -> Vec<String> {
    let mut warnings = Vec::new();
    for arg in argv.iter().skip(1).map(|a| a.to_string_lossy()).take_while(|a| a != "--") {
        for (old, new, why) in DEPRECATED {
            let flag = format!("--{old}");
            if arg == flag.as_str() || arg.starts_with(&format!("{flag}=")) {
                warnings.push(format!("{flag} is deprecated: use --{new} ({why})"));
            }
        }
    }
    warnings
}

/// A study's point changes a few of the study's options (crate::train::options::RunConfig
/// holds the table; setting a key needs the options' sections, which this file knows).
impl RunConfig {
    /// Sets option `long` (its long name) to `value` in its section, or removes it (None): a
    /// study's point changes a few options of the study's.
    pub fn set(&mut self, long: &str, value: Option<toml::Value>) {
        let command = train_command();
        let Some(arg) = command.get_arguments().find(|a| a.get_long() == Some(long)) else {
            debug_assert!(false, "--{long} is not a training option");
            return;
        };
        let section = section_of(arg);
        let key = run_file_key(long);
        let table = self.table.entry(section).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(table) = table {
            match value {
                Some(v) => drop(table.insert(key, v)),
                None => drop(table.remove(&key)),
            }
        }
    }

}

/// The training options alone, as clap defines them (the command line's and every file's).
pub fn train_command() -> Command {
    TrainArgs::augment_args(Command::new("hpc-train").no_binary_name(true))
}

fn section_of(arg: &Arg) -> String {
    let heading = arg.get_help_heading().unwrap_or("Run");
    SECTIONS.iter().find(|(h, _)| *h == heading).map_or_else(|| run_file_key(&heading.to_lowercase().replace(' ', "-")), |(_, s)| s.to_string())
}

/// What a run file and a preset add to a command line: the extra arguments, and which options
/// came from where.
pub struct Additions {
    /// `--long=value` (or `--long` for a switch) for every option the file or preset sets and
    /// the command line does not.
    pub args: Vec<OsString>,
    /// Ids of the options a preset set (not "given": an option a preset sets is a default).
    pub preset_ids: Vec<String>,
    /// The run file and the long names of the options it set.
    pub file: Option<(PathBuf, BTreeSet<String>)>,
    /// Deprecated keys the file used.
    pub warnings: Vec<String>,
}

/// The arguments that `--config` (when `matches` has one) and `--preset` add to a command line
/// whose training options parsed into `matches`: each option the command line did not give,
/// from the file, else from the preset; an option that conflicts with one given on the command
/// line (e.g. the file's --measured-steps against the command line's --steps) is left out, the
/// command line winning. Refuses, in one line naming the file and the key, a file that does not
/// read, an unknown key, a value of the wrong type, and two keys of the file that conflict.
pub fn additions(matches: &ArgMatches) -> Result<Additions, String> {
    use crate::train::options::Preset;
    let command = train_command();
    let on_command_line = |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    let given: Vec<String> = command.get_arguments().map(|a| a.get_id().as_str().to_string()).filter(|id| on_command_line(id)).collect();
    let conflicts = |a: &Arg, b: &Arg| command.get_arg_conflicts_with(a).iter().any(|c| c.get_id() == b.get_id()) || command.get_arg_conflicts_with(b).iter().any(|c| c.get_id() == a.get_id());
    let by_id = |id: &str| command.get_arguments().find(|a| a.get_id() == id).expect("an id of the command");

    // The file's options: (id, the command-line arguments that set it).
    let mut from_file: Vec<(String, Vec<OsString>)> = Vec::new();
    let mut warnings = Vec::new();
    let path = matches.get_one::<PathBuf>("config").cloned();
    if let Some(path) = &path {
        let text = std::fs::read_to_string(path).map_err(|e| format!("--config {}: {e}", path.display()))?;
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let line = e.span().map_or(0, |s| text[..s.start.min(text.len())].lines().count().max(1));
            format!("--config {}: not TOML (line {line}): {}", path.display(), e.message().trim().replace('\n', "; "))
        })?;
        for (key, value, arg) in keys(&command, path, &table)? {
            if let Some((_, new, why)) = DEPRECATED.iter().find(|(old, _, _)| run_file_key(old) == key) {
                warnings.push(format!("{}: key `{key}` is deprecated: use `{}` ({why})", path.display(), run_file_key(new)));
            }
            from_file.push((arg.get_id().as_str().to_string(), argument_text(&command, path, &key, arg, &value)?));
        }
    }
    // The preset: named on the command line, else in the file.
    let preset = match matches.get_one::<Preset>("preset") {
        Some(p) => Some(*p),
        None => from_file.iter().find(|(id, _)| id == "preset").and_then(|(_, args)| {
            let text = args[0].to_string_lossy().into_owned();
            <Preset as clap::ValueEnum>::from_str(text.split_once('=').map_or("", |(_, v)| v), false).ok()
        }),
    };
    let preset_options: &[(&str, &str)] = preset.map_or(&[], |p| p.options());
    let preset_sets = |arg: &Arg| preset_options.iter().any(|(long, _)| arg.get_long() == Some(long));

    // A file's value that is the option's default changes nothing (and is not "given", so
    // that a file written by --print-config, which holds every option, reads back as the run
    // it came from); it is kept where it overrides the preset's.
    let file_ids: Vec<&str> = from_file.iter().map(|(id, _)| id.as_str()).collect();
    let effective: Vec<&(String, Vec<OsString>)> = from_file.iter().filter(|(id, args)| preset_sets(by_id(id)) || !is_default(by_id(id), args)).collect();
    if let Some(path) = &path {
        // Two keys of the file that cannot go together are the file's mistake, not a choice
        // (unless the command line replaces one of them).
        for (i, (a, _)) in effective.iter().enumerate() {
            for (b, _) in &effective[i + 1..] {
                let (a, b) = (by_id(a), by_id(b));
                if conflicts(a, b) && !given.iter().any(|g| conflicts(by_id(g), a) || conflicts(by_id(g), b) || g == a.get_id() || g == b.get_id()) {
                    return Err(format!(
                        "--config {}: keys `{}` and `{}` cannot be used together",
                        path.display(),
                        run_file_key(a.get_long().unwrap_or_default()),
                        run_file_key(b.get_long().unwrap_or_default())
                    ));
                }
            }
        }
    }

    let mut args = Vec::new();
    let mut taken: Vec<String> = given.clone();
    let mut file_longs = BTreeSet::new();
    for (id, file_args) in effective {
        let arg = by_id(id);
        if taken.contains(id) || taken.iter().any(|t| conflicts(by_id(t), arg)) {
            continue;
        }
        args.extend(file_args.iter().cloned());
        file_longs.insert(arg.get_long().expect("found by its long name").to_string());
        taken.push(id.clone());
    }
    let mut preset_ids = Vec::new();
    for &(long, value) in preset_options {
        let arg = command.get_arguments().find(|a| a.get_long() == Some(long)).expect("tests/every_preset_names_options_of_the_command_line");
        let id = arg.get_id().as_str().to_string();
        // An option the command line or the file set wins; so does one set there that cannot
        // go with it (a length given replaces the preset's --measured-steps).
        if taken.contains(&id) || file_ids.contains(&id.as_str()) || taken.iter().any(|t| conflicts(by_id(t), arg)) {
            continue;
        }
        match arg.get_action() {
            ArgAction::SetTrue if value == "true" => args.push(format!("--{long}").into()),
            ArgAction::SetTrue => {}
            _ => args.push(format!("--{long}={value}").into()),
        }
        preset_ids.push(id);
    }
    Ok(Additions { args, preset_ids, file: path.map(|p| (p, file_longs)), warnings })
}

/// Whether the arguments `args` (from [`argument_text`]) set option `arg` to its default.
fn is_default(arg: &Arg, args: &[OsString]) -> bool {
    if matches!(arg.get_action(), ArgAction::SetTrue) {
        return args.is_empty();
    }
    let [one] = args else { return false };
    let text = one.to_string_lossy();
    let value = text.split_once('=').map_or("", |(_, v)| v);
    let defaults: Vec<String> = arg.get_default_values().iter().map(|d| d.to_string_lossy().into_owned()).collect();
    let delimiter = arg.get_value_delimiter().map(String::from).unwrap_or_default();
    let default = defaults.join(&delimiter);
    if defaults.is_empty() {
        return false;
    }
    value == default || matches!((value.parse::<f64>(), default.parse::<f64>()), (Ok(a), Ok(b)) if a == b)
}

/// The keys of a file's table with their values and options, sections flattened; refuses an
/// unknown key, a key given twice, and an option no run file holds.
fn keys<'c>(command: &'c Command, path: &Path, table: &toml::Table) -> Result<Vec<(String, toml::Value, &'c Arg)>, String> {
    let known = |key: &str| {
        let long = key.replace('_', "-");
        command.get_arguments().find(|a| a.get_long() == Some(long.as_str()) || a.get_all_aliases().is_some_and(|all| all.contains(&long.as_str())))
    };
    let mut found = Vec::new();
    let mut seen = BTreeSet::new();
    let mut visit = |key: &str, value: &toml::Value, section: Option<&str>| -> Result<(), String> {
        let place = section.map_or(String::new(), |s| format!(" in [{s}]"));
        let arg = known(key).ok_or_else(|| format!("--config {}: unknown key `{key}`{place} (keys are the options' long names with _ for -, as --print-config writes them)", path.display()))?;
        if NOT_IN_FILES.contains(&arg.get_id().as_str()) {
            return Err(format!("--config {}: key `{key}`: a run file cannot name another run file or print one", path.display()));
        }
        if !seen.insert(arg.get_id().as_str().to_string()) {
            return Err(format!("--config {}: key `{key}` sets --{} a second time", path.display(), arg.get_long().unwrap_or_default()));
        }
        found.push((key.to_string(), value.clone(), arg));
        Ok(())
    };
    for (name, value) in table {
        match value {
            toml::Value::Table(section) => {
                for (key, value) in section {
                    if let toml::Value::Table(_) = value {
                        return Err(format!("--config {}: [{name}.{key}]: sections are one level deep", path.display()));
                    }
                    visit(key, value, Some(name))?;
                }
            }
            _ => visit(name, value, None)?,
        }
    }
    Ok(found)
}

/// The command-line arguments that set option `arg` to a file's `value`, checked by clap's own
/// parser of that option; a value of the wrong type is refused naming the key and the file.
fn argument_text(command: &Command, path: &Path, key: &str, arg: &Arg, value: &toml::Value) -> Result<Vec<OsString>, String> {
    let long = arg.get_long().expect("found by its long name");
    let wrong = |expected: &str| format!("--config {}: key `{key}` = {value}: expected {expected}", path.display());
    let scalar = |v: &toml::Value| match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(float_text(*f)),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        _ => Err(wrong("a string, number or boolean")),
    };
    let args: Vec<OsString> = match (arg.get_action(), value) {
        (ArgAction::SetTrue, toml::Value::Boolean(true)) => vec![format!("--{long}").into()],
        (ArgAction::SetTrue, toml::Value::Boolean(false)) => vec![],
        (ArgAction::SetTrue, _) => return Err(wrong("true or false")),
        (_, toml::Value::Array(items)) => {
            let Some(delimiter) = arg.get_value_delimiter() else { return Err(wrong("one value, not a list")) };
            let items = items.iter().map(scalar).collect::<Result<Vec<_>, _>>()?;
            vec![format!("--{long}={}", items.join(&delimiter.to_string())).into()]
        }
        (_, v) => vec![format!("--{long}={}", scalar(v)?).into()],
    };
    // The value checked alone, by the option's own parser (ranges, enums, numbers).
    let mut alone = command.clone();
    if let Err(e) = alone.try_get_matches_from_mut(&args) {
        let rendered = e.to_string();
        let detail = rendered.lines().next().unwrap_or_default().trim_start_matches("error: ");
        return Err(format!("--config {}: key `{key}` = {value}: {detail}", path.display()));
    }
    Ok(args)
}

/// A float as text that parses back to the same number (1e-8, not 0.00000001's rounding).
fn float_text(f: f64) -> String {
    format!("{f:?}")
}

/// The resolved training options of a parsed command line (`matches` of the training options,
/// after [`additions`]), by section, as a run file holds them: every option with a value (a
/// default included), so that the file says everything the run used; options without a value
/// (unset `Option`s) are left out, which a file reads back as unset. Hidden options (test
/// hooks) only where set.
pub fn resolved(matches: &ArgMatches) -> RunConfig {
    let command = train_command();
    let mut table = toml::Table::new();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        if NOT_IN_FILES.contains(&id) || arg.get_long().is_none() {
            continue;
        }
        let source = matches.value_source(id);
        if arg.is_hide_set() && source != Some(clap::parser::ValueSource::CommandLine) {
            continue;
        }
        let value = match arg.get_action() {
            ArgAction::SetTrue => toml::Value::Boolean(matches.get_flag(id)),
            _ => {
                let Some(raw) = matches.get_raw(id) else { continue };
                let values: Vec<toml::Value> = raw.map(|v| typed(&v.to_string_lossy())).collect();
                match (values.len(), arg.get_value_delimiter()) {
                    (1, None) => values.into_iter().next().expect("one"),
                    _ => toml::Value::Array(values),
                }
            }
        };
        let section = table.entry(section_of(arg)).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(section) = section {
            section.insert(run_file_key(arg.get_long().expect("checked")), value);
        }
    }
    RunConfig { table, file: None, warnings: Vec::new() }
}

/// A command-line value as the TOML value a person would write: a number or a boolean where it
/// is one, else a string (every option reads any of them back through its own parser).
fn typed(text: &str) -> toml::Value {
    if let Ok(i) = text.parse::<i64>() {
        return toml::Value::Integer(i);
    }
    if text.chars().any(|c| c.is_ascii_digit()) {
        if let Ok(f) = text.parse::<f64>() {
            if f.is_finite() {
                return toml::Value::Float(f);
            }
        }
    }
    match text {
        "true" => toml::Value::Boolean(true),
        "false" => toml::Value::Boolean(false),
        _ => toml::Value::String(text.to_string()),
    }
}
