pub fn g() {}

#[cfg(test)]
mod tests {
    #[test]
    fn t() {
        super::super::c::h()
    }
}
