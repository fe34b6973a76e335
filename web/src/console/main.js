import '../styles/console.css';
